"""Issue 32's costs, each against the default in the same process, run alternately:
- a decode step with the routed experts stored (SamplingParams.return_routed_experts: every MoE layer's top-k ids
  per token written at its KV slot) against one without;
- a GRPO training forward + backward with routing replay (R3: the decoder's experts, gate weights gathered from
  the trainer's own router) against the trainer's own routing.

CPU: the small random Qwen3-MoE of bench_decode (H 256, 4 layers, 32 experts top-4), fp32, batch 64 (quick: 16)
decode steps with 8 timed steps per repetition, median of 5 repetitions (quick: 1); the training step on 16
sequences of 128 tokens. GPU: the same model in bf16 (the decode graphs are recaptured with the routing buffer).
"""
import statistics
import time

import pytest
import torch

from bench.bench_decode import MODELS, random_prompts
from bench.common import median_times, record, sync
from livemoe.engine.llm import LLM
from livemoe.engine.model.loader import load_model
from livemoe.engine.sampling.params import SamplingParams
from livemoe.kernels.moe import select_experts

SUITE = "mismatch"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from tiny_models import make_checkpoint

    return make_checkpoint(tmp_path_factory.mktemp("bench_mismatch") / "small", moe=True, **MODELS["small MoE"])[0]


def set_capture(llm: LLM, on: bool) -> None:
    """The runner's routing capture on or off (a benchmark's switch: the engine only ever turns it on)."""
    runner = llm.core.runner
    if runner.capture_routing != on:
        runner.capture_routing = on
        runner.graphs.clear()
        runner.graph_vars.clear()


def decode_steps(llm: LLM, on: bool, steps: int) -> float:
    set_capture(llm, on)
    for _ in range(2):  # warm-up (and graph capture on a GPU)
        llm.step()
    times = []
    for _ in range(steps):
        sync(llm.core.runner.device)
        t0 = time.perf_counter()
        llm.step()
        sync(llm.core.runner.device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def test_decode_step_with_routed_experts(ckpt, bench_mode, device):
    batch, steps, reps = (64, 8, 5) if bench_mode == "full" else (16, 4, 1)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    llm = LLM(ckpt, dtype=dtype, device=device, num_kv_blocks=1024, max_model_len=512, max_num_seqs=batch,
              use_tqdm=False)
    for i, p in enumerate(random_prompts(batch, 32, 64, MODELS["small MoE"]["vocab_size"])):
        llm.add_request(p, SamplingParams(temperature=1.0, seed=i, max_tokens=400, ignore_eos=True,
                                          return_routed_experts=True))
    while any(s.num_output_tokens == 0 for r in llm.core.requests.values() for s in r.seqs):
        llm.step()  # prefill
    t_on, t_off = median_times(lambda: decode_steps(llm, True, steps), lambda: decode_steps(llm, False, steps), reps)
    record(suite=SUITE, case=f"decode step, batch {batch}, routed experts stored", metric="ms", ours=t_on * 1e3,
           baseline=t_off * 1e3, baseline_name="not stored", kind="overhead")
    assert t_on > 0 and t_off > 0


def test_training_step_with_routing_replay(ckpt, bench_mode, device):
    rows, length, reps = (16, 128, 5) if bench_mode == "full" else (4, 64, 1)
    model = load_model(ckpt, dtype=torch.float32, device=device)
    cfg = model.config
    ids = torch.tensor(random_prompts(rows, length, length, cfg.vocab_size, seed=1), device=device)
    with torch.no_grad():
        _, logits = model.forward_hidden(ids, return_router_logits=True)
    routed = torch.stack([select_experts(x, cfg.num_experts_per_tok) for x in logits], 1)
    routed = routed.view(rows, length, -1, cfg.num_experts_per_tok).to(torch.uint8)
    autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=device == "cuda")

    def step(replay) -> float:
        sync(device)
        t0 = time.perf_counter()
        with autocast:
            hidden = model.forward_hidden(ids, routed_experts=replay)
        hidden.float().square().mean().backward()
        sync(device)
        model.zero_grad(set_to_none=True)
        return time.perf_counter() - t0

    step(None), step(routed)  # warm-up
    t_on, t_off = median_times(lambda: step(routed), lambda: step(None), reps)
    record(suite=SUITE, case=f"training forward + backward, {rows} x {length} tokens, R3", metric="ms",
           ours=t_on * 1e3, baseline=t_off * 1e3, baseline_name="own routing", kind="overhead")
    assert t_on > 0 and t_off > 0
