"""Per-part cost of a batch-1 decode step (M=student|moe, D=f32|f16; CPU=1: thread CPU time, else wall), wrappers
around the engine's parts, p50 and p10 over 635 steps. PYTHONPATH=<checkout> M=moe D=f16 CPU=1 python parts.py."""

import os
import sys
import time
import collections
import torch

sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "tests"))
sys.path.insert(0, os.environ["PYTHONPATH"])
from bench.bench_decode import random_prompts
from livemoe.engine.llm import LLM
from livemoe.engine.sampling.params import SamplingParams
import livemoe.engine.model.fused_decode as fd
import livemoe.engine.decoder.engine_core as ec
import livemoe.engine.decoder.model_runner as mr
import livemoe.engine.decoder.scheduler as sch
import livemoe.engine.model.qwen3 as q3

torch.set_num_threads(1)
CLK = time.thread_time if os.environ.get("CPU") else time.perf_counter
T = collections.defaultdict(list)
on = [False]


def wrap(owner, name, label):
    f = getattr(owner, name)

    def w(*a, **k):
        t = CLK()
        r = f(*a, **k)
        if on[0]:
            T[label].append(CLK() - t)
        return r

    setattr(owner, name, w)


wrap(sch.Scheduler, "schedule", "schedule")
wrap(mr.ModelRunner, "plan", "runner plan")
wrap(mr.ModelRunner, "step_inputs", "step inputs")
wrap(mr.ModelRunner, "execute", "execute (all)")
wrap(mr.ModelRunner, "_run_eager", "forward (all)")
wrap(q3.fused_decode if hasattr(q3, "fused_decode") else fd, "plan", "fused plan+check")
wrap(q3.fused_decode if hasattr(q3, "fused_decode") else fd, "run_step", "run_step (C++ step + glue)")
wrap(q3.Qwen3ForCausalLM, "compute_logits", "compute_logits")
for n in ("greedy_tokens",):
    if hasattr(ec, n):
        wrap(ec, n, n)
wrap(ec.EngineCore, "_fail_nonfinite_rows", "nonfinite check")
wrap(ec.EngineCore, "_emit", "emit")
wrap(ec.EngineCore, "_outputs", "outputs")
wrap(ec.EngineCore, "_param_version", "param version")
wrap(sch.Scheduler, "update_computed", "update_computed")
wrap(ec.EngineCore, "step", "whole step")
m, d = os.environ["M"], os.environ["D"]
path = os.path.join(os.environ["PYTHONPATH"], "livemoe/train/assets/student") if m == "student" else "/tmp/38/small_moe"
llm = LLM(
    path,
    dtype=torch.float32 if d == "f32" else torch.float16,
    device="cpu",
    max_num_seqs=64,
    num_kv_blocks=64 * 8,
    use_tqdm=False,
)
params = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
for rep in range(6):
    llm.reset_prefix_cache()
    llm.add_request(random_prompts(1, 32, 32, llm.model.config.vocab_size, seed=rep)[0], params)
    llm.step()
    on[0] = rep > 0
    while llm.has_unfinished_requests():
        llm.step()
    on[0] = False

for k, v in T.items():
    v.sort()
    print(f"{k:30s} p50 {1e6 * v[len(v) // 2]:7.1f} us  p10 {1e6 * v[len(v) // 10]:7.1f}  n {len(v)}")
print("load", os.getloadavg())
