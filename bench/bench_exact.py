"""Issue 32's exact on-policy mode: what the batch-invariant kernels cost, each against the default kernels in the
same process, run alternately:
- a decode step of the engine with EngineConfig.batch_invariant on against off (one engine, the switch flipped
  between repetitions: the same sequences, the same cache);
- a GRPO training forward + backward (forward_hidden + fused_linear_logprobs, the trainer's) in the exact mode
  against the default kernels.

CPU only (the exact kernels have no GPU version yet). The small random Qwen3-MoE of bench_decode (H 256, 4
layers, 32 experts top-4), fp32, batch 64 (quick: 16) decode steps with 8 timed steps per repetition, median of
5 repetitions (quick: 1); the training step on 16 sequences of 128 tokens (quick: 4 of 64).
"""
import time

import pytest
import torch

from bench.bench_decode import MODELS, random_prompts
from bench.bench_mismatch import decode_steps
from bench.common import median_times, record
from livemoe.engine.llm import LLM
from livemoe.engine.model.loader import load_model
from livemoe.engine.sampling.params import SamplingParams
from livemoe.kernels.batch_invariant import batch_invariant_mode, unavailable_reason
from livemoe.kernels.logprobs import fused_linear_logprobs

SUITE = "exact"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tiny_models import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("bench_exact") / "small", moe=True, **MODELS["small MoE"])[0]


@pytest.fixture
def cpu_only(device):
    if unavailable_reason(device):
        pytest.skip(f"exact mode: {unavailable_reason(device)}")


def test_decode_step_exact(ckpt, bench_mode, device, cpu_only):
    batch, steps, reps = (64, 8, 5) if bench_mode == "full" else (16, 4, 1)
    llm = LLM(ckpt, dtype=torch.float32, device=device, num_kv_blocks=1024, max_model_len=512, max_num_seqs=batch,
              use_tqdm=False, batch_invariant=True)
    for i, p in enumerate(random_prompts(batch, 32, 64, MODELS["small MoE"]["vocab_size"])):
        llm.add_request(p, SamplingParams(temperature=1.0, seed=i, max_tokens=400, ignore_eos=True, logprobs=0))
    while any(s.num_output_tokens == 0 for r in llm.core.requests.values() for s in r.seqs):
        llm.step()  # prefill
    config = llm.core.config

    def run(exact: bool) -> float:
        config.batch_invariant = exact
        return decode_steps(llm, False, steps)

    t_on, t_off = median_times(lambda: run(True), lambda: run(False), reps)
    record(suite=SUITE, case=f"decode step, batch {batch}, exact mode", metric="ms", ours=t_on * 1e3,
           baseline=t_off * 1e3, baseline_name="default kernels", kind="overhead")
    assert t_on > 0 and t_off > 0


def test_training_step_exact(ckpt, bench_mode, device, cpu_only):
    rows, length, reps = (16, 128, 5) if bench_mode == "full" else (4, 64, 1)
    model = load_model(ckpt, dtype=torch.float32, device=device)
    ids = torch.tensor(random_prompts(rows, length, length, model.config.vocab_size, seed=1), device=device)

    def step(exact: bool) -> float:
        t0 = time.perf_counter()
        with batch_invariant_mode(exact):
            hidden = model.forward_hidden(ids)
            lp = fused_linear_logprobs(hidden[:, :-1], model.lm_head_weight, ids[:, 1:], 0.7)
        lp.sum().backward()
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step(True), step(False)  # warm-up
    t_on, t_off = median_times(lambda: step(True), lambda: step(False), reps)
    record(suite=SUITE, case=f"training forward + backward, {rows} x {length} tokens, exact mode", metric="ms",
           ours=t_on * 1e3, baseline=t_off * 1e3, baseline_name="default kernels", kind="overhead")
    assert t_on > 0 and t_off > 0
