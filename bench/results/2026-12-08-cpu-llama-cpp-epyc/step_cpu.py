"""Thread CPU and wall us per decode step of our engine (the committed student and the small MoE, f32 and f16, batch
B), alternated reps in one process; greedy tokens checked equal across reps (TOKS: written to a file). Run from a
checkout: PYTHONPATH=<checkout> [B=1 NEW=64 REPS=5 MODELS=student,moe DT=f32,f16] python step_cpu.py."""

import json
import os
import sys
import time
import torch

sys.path.insert(0, os.path.join(os.environ["PYTHONPATH"], "tests"))
sys.path.insert(0, os.environ["PYTHONPATH"])
from tiny_models import make_checkpoint
from bench.bench_decode import MODELS, random_prompts
from livemoe.engine.llm import LLM
from livemoe.engine.sampling.params import SamplingParams

torch.set_num_threads(1)
new, plen = int(os.environ.get("NEW", "64")), 32
B = int(os.environ.get("B", "1"))
reps = int(os.environ.get("REPS", "5"))
paths = {"student": os.path.join(os.environ["PYTHONPATH"], "livemoe/train/assets/student")}
p = "/tmp/38/small_moe"
if not os.path.exists(p + "/config.json"):
    make_checkpoint(p, moe=True, **MODELS["small MoE"])
paths["moe"] = p


def decode(llm, prompts):
    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
    ids = [llm.add_request(q, params) for q in prompts]
    toks = {}
    while len(toks) < len(ids) or any(not t for t in toks.values()):
        for o in llm.step():
            toks[o.request_id] = list(o.outputs[0].token_ids)
    t0 = time.perf_counter()
    c0 = time.thread_time()
    n = 0
    while llm.has_unfinished_requests():
        for o in llm.step():
            toks[o.request_id] = list(o.outputs[0].token_ids)
        n += 1
    return [toks[i] for i in ids], (time.perf_counter() - t0) / n, (time.thread_time() - c0) / n


cases = [
    (m, d)
    for m in os.environ.get("MODELS", "student,moe").split(",")
    for d in os.environ.get("DT", "f32,f16").split(",")
]
llms = {}
for m, d in cases:
    llms[m, d] = LLM(
        paths[m],
        dtype=torch.float32 if d == "f32" else torch.float16,
        device="cpu",
        max_num_seqs=64,
        num_kv_blocks=64 * ((plen + new) // 16 + 2),
        use_tqdm=False,
    )
res = {c: [] for c in cases}
toks = {}
for c in cases:
    vocab = llms[c].model.config.vocab_size
    toks[c] = decode(llms[c], random_prompts(B, plen, plen, vocab, seed=B))[0]
for _ in range(reps):
    for c in cases:
        vocab = llms[c].model.config.vocab_size
        t, w, cpu = decode(llms[c], random_prompts(B, plen, plen, vocab, seed=B))
        assert t == toks[c]
        res[c].append((w, cpu))

for c in cases:
    ws = sorted(x[0] for x in res[c])
    cs = sorted(x[1] for x in res[c])
    print(
        f"{c[0]} {c[1]} B{B}: wall med {1e6 * ws[len(ws) // 2]:.0f} us/step min {1e6 * ws[0]:.0f}; cpu med {1e6 * cs[len(cs) // 2]:.0f} min {1e6 * cs[0]:.0f}",
        "load",
        os.getloadavg()[0],
    )
if os.environ.get("TOKS"):
    json.dump({f"{k[0]}-{k[1]}": v for k, v in toks.items()}, open(os.environ["TOKS"], "w"))
