"""Issue 32's exact on-policy mode: what the batch-invariant kernels cost, each against the default kernels in the
same process, run alternately:
- a decode step of the engine with EngineConfig.batch_invariant on against off (one engine, the switch flipped
  between repetitions: the same sequences, the same cache);
- a GRPO training forward + backward (forward_hidden + fused_linear_logprobs, the trainer's) in the exact mode
  against the default kernels.

- on a GPU, each exact Triton kernel against the default one at Qwen3-30B-A3B's shapes in bf16 (one layer's
  qkv projection and MoE, decode attention at a 4096-token context, the trainer's causal attention, the
  log-softmax of the vocabulary), at decode and training token counts.

The first two on the small random Qwen3-MoE of bench_decode (H 256, 4 layers, 32 experts top-4), fp32 (on a GPU
bf16, eager: an engine's decode graphs hold the kernels of the mode they were captured in, so flipping the switch
needs eager steps), batch 64 (quick: 16) decode steps with 8 timed steps per repetition, median of 5 repetitions
(quick: 1); the training step on 16 sequences of 128 tokens (quick: 4 of 64).
"""
import time

import pytest
import torch

from bench.bench_decode import MODELS, random_prompts
from bench.bench_mismatch import decode_steps
from bench.common import measure, median_times, record, sync
from bench.kernel_launches import Qwen3Shapes
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
def available(device):
    if unavailable_reason(device):
        pytest.skip(f"exact mode: {unavailable_reason(device)}")


def _dtype(device) -> torch.dtype:
    return torch.bfloat16 if device == "cuda" else torch.float32


def test_decode_step_exact(ckpt, bench_mode, device, available):
    batch, steps, reps = (64, 8, 5) if bench_mode == "full" else (16, 4, 1)
    llm = LLM(ckpt, dtype=_dtype(device), device=device, num_kv_blocks=1024, max_model_len=512, max_num_seqs=batch,
              use_tqdm=False, batch_invariant=True, enforce_eager=True)
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


def test_training_step_exact(ckpt, bench_mode, device, available):
    rows, length, reps = (16, 128, 5) if bench_mode == "full" else (4, 64, 1)
    model = load_model(ckpt, dtype=_dtype(device), device=device)
    ids = torch.tensor(random_prompts(rows, length, length, model.config.vocab_size, seed=1), device=device)

    def step(exact: bool) -> float:
        t0 = time.perf_counter()
        with batch_invariant_mode(exact):
            hidden = model.forward_hidden(ids)
            lp = fused_linear_logprobs(hidden[:, :-1], model.lm_head_weight, ids[:, 1:], 0.7)
        lp.sum().backward()
        model.zero_grad(set_to_none=True)
        sync(device)
        return time.perf_counter() - t0

    step(True), step(False)  # warm-up
    t_on, t_off = median_times(lambda: step(True), lambda: step(False), reps)
    record(suite=SUITE, case=f"training forward + backward, {rows} x {length} tokens, exact mode", metric="ms",
           ours=t_on * 1e3, baseline=t_off * 1e3, baseline_name="default kernels", kind="overhead")
    assert t_on > 0 and t_off > 0


def exact_kernel_rows(device: str, dtype: torch.dtype, s: Qwen3Shapes, tokens: tuple, reps: int) -> list[dict]:
    """Each exact kernel (livemoe.kernels.batch_invariant) against the default kernel of the same op, one layer at
    shapes `s`: rows of (case, exact seconds, default seconds, default's name), timed alternately."""
    import torch.nn.functional as F

    from bench.bench_attention import paged_inputs
    from livemoe.engine.model.attention import causal_attention
    from livemoe.kernels.attention import paged_decode_attention
    from livemoe.kernels.batch_invariant import ops as bi
    from livemoe.kernels.moe import fused_moe

    g = torch.Generator(device=device).manual_seed(0)
    rnd = lambda *shape, scale=1.0: torch.randn(*shape, generator=g, device=device).mul_(scale).to(dtype)  # noqa: E731
    H, d, hq, hkv = s.hidden, s.head_dim, s.q_heads, s.kv_heads
    w_qkv = rnd((hq + 2 * hkv) * d, H, scale=H ** -0.5)
    w_gate_up, w_down = rnd(s.experts, 2 * s.moe_inter, H, scale=H ** -0.5), rnd(s.experts, H, s.moe_inter,
                                                                                scale=s.moe_inter ** -0.5)
    rows = []

    def time_pair(case, ours, baseline, name):
        ours(), baseline()  # compiles, and the first call's allocations
        t_ours, t_base = median_times(lambda: measure(ours, device, reps=reps), lambda: measure(baseline, device,
                                                                                               reps=reps), 3)
        rows.append(dict(case=case, ours=t_ours, baseline=t_base, baseline_name=name))

    for T in tokens:
        x, router = rnd(T, H), rnd(T, s.experts).float()
        time_pair(f"qkv projection, {T} tokens", lambda: bi.linear_forward(x, w_qkv), lambda: F.linear(x, w_qkv),
                  "F.linear")

        def exact_moe():
            with batch_invariant_mode():
                return fused_moe(x, w_gate_up, w_down, router, s.top_k, True)

        time_pair(f"MoE layer (routing + experts), {T} tokens", exact_moe,
                  lambda: fused_moe(x, w_gate_up, w_down, router, s.top_k, True), "fused_moe")
    batch = max(tokens[:-1] or tokens)
    q, kc, vc, tables, ctx = paged_inputs(batch, s.context, hq, hkv, d, s.kv_block, dtype, device)
    time_pair(f"decode attention, batch {batch}, context {s.context}",
              lambda: bi.paged_attention_forward(q, kc, vc, None, ctx, tables, d ** -0.5),
              lambda: paged_decode_attention(q, kc, vc, tables, ctx, d ** -0.5), "paged decode (split-KV)")
    T = tokens[-1]
    qt, kt, vt = rnd(1, T, hq, d), rnd(1, T, hkv, d), rnd(1, T, hkv, d)
    time_pair(f"causal attention (training), 1 x {T} tokens", lambda: bi.causal_attention_forward(qt, kt, vt, d ** -0.5),
              lambda: causal_attention(qt, kt, vt, d ** -0.5), "SDPA causal")
    logits = rnd(min(T, 1024), s.vocab).float()
    time_pair(f"log-softmax, {logits.shape[0]} x {s.vocab}", lambda: bi.log_softmax(logits),
              lambda: logits.log_softmax(-1), "torch log_softmax")
    return rows


def test_exact_kernels_gpu(bench_mode, device):
    if device != "cuda":
        pytest.skip("the exact mode's Triton kernels at Qwen3-30B-A3B's shapes: needs a CUDA GPU")
    tokens, reps = ((1, 64, 4096), 20) if bench_mode == "full" else ((1, 64, 1024), 5)
    for row in exact_kernel_rows(device, torch.bfloat16, Qwen3Shapes(), tokens, reps):
        record(suite=SUITE, case=row["case"] + ", exact mode, bf16 Qwen3-30B-A3B", metric="ms", ours=row["ours"] * 1e3,
               baseline=row["baseline"] * 1e3, baseline_name=row["baseline_name"], kind="overhead")
