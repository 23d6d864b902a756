"""The decoder end to end: offline throughput, TTFT and TPOT of `livemoe.engine.LLM` against transformers'
`generate` on the same model in the same process.

CPU, two random Qwen3-MoE checkpoints made by tests/tiny_models.py: the tiny one (H 64, 3 layers, 8 experts
top-2, vocab 131) and a small one (H 256, 4 layers, 32 experts top-4, 8/4 heads of 32, vocab 4096), where the
expert matmuls weigh more than the per-op overhead. Workloads (quick: fewer requests and tokens):
- 64 requests, prompts of 8-48 tokens, greedy with ignore_eos: equal output lengths (32), and a mix of output
  lengths (uniform in [4, 64]: "useful tok/s", the tokens asked for). Baselines: one batched, left-padded
  `generate` call (its strongest offline mode; with the mix it must run every row to the longest), and, for the
  tiny model, `generate` one request at a time.
- GRPO-rollout-shaped: 8 prompts of 32-96 tokens x n=8 samples each, what livemoe/train/rollout.py asks (temperature
  0.7, a seed, the sampled tokens' logprobs), every sample exactly 32 tokens (ignore_eos on ours, no EOS on
  theirs). Baseline: `generate` with num_return_sequences=8, do_sample at temperature 0.7 (top_k off, as ours),
  output_scores=True (what a trainer reads the logprobs from).
transformers runs its fastest settings here: SDPA attention and its grouped_mm experts (its eager attention is
~5% slower on the tiny model; its eager and batched_mm experts are 1.4-25x slower). Both sides run
single-threaded: on this shared 2-core machine OpenMP spin-waits otherwise dominate tiny matmuls, for both
sides alike. Every case is recorded; ratios come from the same process (full mode: the median of 3 runs of
each side, run alternately; quick mode: one run).
GPU: a Qwen3-30B-A3B-shaped model with random bf16 weights made on the device; batch 1, 8, 64 at
contexts 1k and 4k (quick: batch 1 at 1k); ms per decode step against the memory-bound floor (the
weights a step touches plus the KV it reads, at the measured copy bandwidth).
"""
import os
import time

import pytest
import torch

from bench import llamacpp_peer
from bench.common import median_pair, record

SUITE = "decode"
MODELS = {  # name -> tests/tiny_models.py overrides
    "tiny MoE": {},
    "small MoE": dict(hidden_size=256, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128,
                      vocab_size=4096, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32),
}


def random_prompts(num, lo, hi, vocab, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(lo, hi + 1, (num,), generator=g).tolist()
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lens]


def left_padded(prompts):
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    return ids, mask


def hf_generate(hf, prompts, new_tokens, **sampling):
    """One left-padded batch through transformers' generate; returns (seconds, seconds to first token).
    Greedy unless `sampling` (generate's keywords) says otherwise. The first-token call is timed apart."""
    ids, mask = left_padded(prompts)
    kw = {"attention_mask": mask, "do_sample": False, "pad_token_id": 0, **sampling}
    t0 = time.perf_counter()
    hf.generate(ids, max_new_tokens=1, **kw)
    ttft = time.perf_counter() - t0
    t0 = time.perf_counter()
    out = hf.generate(ids, max_new_tokens=new_tokens, **kw)
    total = time.perf_counter() - t0
    seqs = out.sequences if hasattr(out, "sequences") else out
    assert seqs.shape == (ids.shape[0] * sampling.get("num_return_sequences", 1), ids.shape[1] + new_tokens)
    return total, ttft


def hf_sequential(hf, prompts, max_tokens):
    """Each request alone through generate (how a service without batching runs it); seconds."""
    t0 = time.perf_counter()
    for p, n in zip(prompts, max_tokens):
        hf.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return time.perf_counter() - t0


def timed_generate(llm, prompts, params, expect_lens):
    """(seconds, outputs) of one llm.generate call."""
    llm.reset_prefix_cache()  # no blocks cached by an earlier case (transformers keeps nothing between calls)
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    t = time.perf_counter() - t0
    assert [len(c.token_ids) for o in outs for c in o.outputs] == expect_lens
    return t, outs


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU suite; the GPU suite is test_decode_gpu")
@pytest.mark.parametrize("model", list(MODELS))
def test_decode_moe_cpu(benchmark, bench_mode, tmp_path_factory, one_thread, model):
    from livemoe.engine.llm import LLM
    from livemoe.engine.sampling.params import SamplingParams
    from tiny_models import make_checkpoint

    path, hf = make_checkpoint(tmp_path_factory.mktemp("bench_decode") / "moe", moe=True, **MODELS[model])
    hf.generation_config.eos_token_id = None  # both sides generate exactly the tokens asked
    hf.set_attn_implementation("sdpa")  # tiny_models builds it with eager attention (for logits parity)
    vocab = hf.config.vocab_size
    num, new = (64, 32) if bench_mode == "full" else (8, 8)
    reps = 3 if bench_mode == "full" else 1  # each case: medians of `reps` alternating runs of both sides
    prompts = random_prompts(num, 8, 48, vocab)
    # the serving mix: output lengths differ per request (uniform in [new/8, 2*new])
    g = torch.Generator().manual_seed(1)
    mixed = torch.randint(max(1, new // 8), 2 * new + 1, (num,), generator=g).tolist()
    llm = LLM(path, dtype=torch.float32, device="cpu", num_kv_blocks=4096, use_tqdm=False)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=2))  # warm-up
    hf_generate(hf, prompts[:2], 2)

    def greedy(max_tokens):
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in max_tokens]
        return timed_generate(llm, prompts, params, max_tokens)

    benchmark.pedantic(lambda: greedy([new] * num), rounds=1, iterations=1)  # pytest-benchmark's own row
    t_ours, outs, t_hf, ttft_hf = median_pair(lambda: greedy([new] * num), lambda: hf_generate(hf, prompts, new), reps)
    base = "transformers generate (batched)"
    case = f"{model}, {num} requests x {new} tokens"
    tokens = num * new
    record(suite=SUITE, case=case, metric="tok/s", ours=tokens / t_ours, baseline=tokens / t_hf,
           baseline_name=base, higher_is_better=True, extra={"ours_s": t_ours, "baseline_s": t_hf})
    ttft = sum(o.metrics.ttft for o in outs) / num
    tpot = sum(o.metrics.tpot for o in outs) / num
    record(suite=SUITE, case=case, metric="TTFT ms (mean)", ours=ttft * 1e3, baseline=ttft_hf * 1e3, baseline_name=base)
    record(suite=SUITE, case=case, metric="TPOT ms (mean)", ours=tpot * 1e3,
           baseline=(t_hf - ttft_hf) / (new - 1) * 1e3, baseline_name=base)

    # mixed output lengths: a padded batch runs every row to the longest; continuous batching does not
    t_ours, _, t_hf, _ = median_pair(lambda: greedy(mixed), lambda: hf_generate(hf, prompts, max(mixed)), reps)
    case = f"{model}, {num} requests, {min(mixed)}-{max(mixed)} tokens"
    tokens = sum(mixed)
    record(suite=SUITE, case=case, metric="useful tok/s", ours=tokens / t_ours, baseline=tokens / t_hf,
           baseline_name=base, higher_is_better=True, extra={"ours_s": t_ours, "baseline_s": t_hf})
    if model == "tiny MoE":  # one request at a time: minutes on the small model, and says nothing new
        t_seq = hf_sequential(hf, prompts, mixed)
        record(suite=SUITE, case=case, metric="useful tok/s", ours=tokens / t_ours, baseline=tokens / t_seq,
               baseline_name="transformers generate (one request at a time)", higher_is_better=True,
               extra={"ours_s": t_ours, "baseline_s": t_seq})

    # GRPO rollouts: a few prompts, n samples each (the samples of a prompt share its cached blocks)
    num_prompts, n = (8, 8) if bench_mode == "full" else (2, 4)
    rollout_prompts = random_prompts(num_prompts, 32, 96, vocab, seed=2)
    params = SamplingParams(temperature=0.7, n=n, max_tokens=new, ignore_eos=True, seed=0, logprobs=0)
    t_ours, _, t_hf, _ = median_pair(
        lambda: timed_generate(llm, rollout_prompts, params, [new] * (num_prompts * n)),
        lambda: hf_generate(hf, rollout_prompts, new, do_sample=True, temperature=0.7, top_k=0, top_p=1.0,
                            num_return_sequences=n, output_scores=True, return_dict_in_generate=True), reps)
    case = f"{model}, GRPO rollouts: {num_prompts} prompts x n={n} x {new} tokens"
    tokens = num_prompts * n * new
    record(suite=SUITE, case=case, metric="tok/s", ours=tokens / t_ours, baseline=tokens / t_hf,
           baseline_name=base + ", num_return_sequences", higher_is_better=True,
           extra={"ours_s": t_ours, "baseline_s": t_hf})


def decode_floor_s(cfg, batch: int, context: int, bandwidth_Bps: float, dtype_bytes: int = 2) -> float:
    """Bytes a decode step must read (shared weights, the experts its tokens touch, their KV) / bandwidth."""
    from bench.roofline import decode_step

    return decode_step(cfg, batch, context, dtype_bytes).bytes / bandwidth_Bps


@pytest.mark.gpu
def test_decode_gpu(benchmark, bench_mode):
    from bench.ceilings import measure_ceilings
    from bench.roofline import decode_step, predict_s
    from livemoe.engine.model.flops import resolve_config
    from livemoe.engine.llm import LLM
    from livemoe.engine.model.loader import init_model
    from livemoe.engine.sampling.params import SamplingParams

    ceil = measure_ceilings("cuda")
    cfg = resolve_config("qwen3-30b-a3b")
    model = init_model(cfg, dtype=torch.bfloat16, device="cuda")
    cases = [(1, 1024)] if bench_mode == "quick" else [(b, c) for c in (1024, 4096) for b in (1, 8, 64)]
    new = 32 if bench_mode == "quick" else 64
    llm = LLM.from_model(model, None, max_num_seqs=64, max_model_len=4096 + 128, use_tqdm=False)
    for batch, context in cases:
        prompts = random_prompts(batch, context, context, cfg.vocab_size, seed=batch)
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up, graphs
        box = {}

        def ours():
            box["outs"] = llm.generate(prompts, params)

        if (batch, context) == cases[0]:
            benchmark.pedantic(ours, rounds=1, iterations=1)
        else:
            ours()
        tpot = sum(o.metrics.tpot for o in box["outs"]) / batch
        floor = decode_floor_s(cfg, batch, context, ceil["copy_GBps"] * 1e9)
        model = predict_s(decode_step(cfg, batch, context))
        record(suite=SUITE, case=f"Qwen3-30B-A3B shape bf16, batch {batch}, context {context}", metric="ms/step",
               ours=tpot * 1e3, floor=floor * 1e3, model=model * 1e3,
               extra={"eager_fallbacks": llm.stats()["num_eager_fallbacks"], "copy_GBps": ceil["copy_GBps"]})


# -- against llama.cpp ---------------------------------------------------------------------------------------------
# The same checkpoints as GGUF (livemoe export-gguf), decoded greedily by llama.cpp in this process through
# llama-cpp-python (bench/llamacpp_peer.py: one llama_decode per step for the whole batch, as llama-batched-bench).
# Greedy tokens are compared before anything is timed. Decode tok/s = batch x (new - 1) tokens over the steps after
# every sequence has its first token, on both sides; ratios are medians of alternated runs.
PEER_MODELS = {"committed student": None, "small MoE": MODELS["small MoE"]}
# (batch, dtype) at each of --benchmark-threads (1 by default; 1 and 2 with --benchmark-full: on a shared 2-core
# machine OpenMP spin-waits make the 2-thread cases long)
PEER_CASES_FULL = [(b, dtype) for dtype in ("f32", "f16") for b in (1, 8, 64)]
PEER_CASES_QUICK = [(1, "f32")]
# f32: where llama.cpp's greedy token differs from ours, ours is at a near-tie: of its two top logits there, or of
# an MoE router's k-th and (k+1)-th expert at that token or an earlier one (the two sides sum in other orders, so a
# near-tied router picks other experts, and the continuations part). Random prompts on random weights meet one
# within ~10-60 tokens; a real difference in the computation parts without any.
PEER_TIE = 1e-3


def tie_gaps(model, prompts, ours, theirs, common) -> list[float]:
    """For each sequence where the two parted: the smallest of our top-2 logit gap there and, for MoE layers, the
    k-th minus (k+1)-th router logit at every token up to there (a plain forward over the prompt and the prefix)."""
    gaps = []
    k = model.config.num_experts_per_tok
    with torch.inference_mode():
        for prompt, a, b, i in zip(prompts, ours, theirs, common):
            if i >= min(len(a), len(b)):
                continue
            hidden, routers = model.forward_hidden(torch.tensor([prompt + a[:i]]), return_router_logits=True)
            logits = model.compute_logits(hidden[0, -1]).float()
            gap = float(logits[a[i]] - logits[b[i]])
            for r in routers:
                top = r.float().topk(k + 1, dim=-1).values
                gap = min(gap, float((top[:, k - 1] - top[:, k]).min()))
            gaps.append(gap)
    return gaps


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def ours_greedy_decode(llm, prompts, new_tokens) -> tuple[list[list[int]], float]:
    """(each prompt's greedy tokens, seconds of the steps after every sequence has its first token)."""
    from livemoe.engine.sampling.params import SamplingParams

    llm.reset_prefix_cache()
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    ids = [llm.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {}
    while len(tokens) < len(ids) or any(not t for t in tokens.values()):
        for o in llm.step():
            tokens[o.request_id] = list(o.outputs[0].token_ids)
    t0 = time.perf_counter()
    while llm.has_unfinished_requests():
        for o in llm.step():
            tokens[o.request_id] = list(o.outputs[0].token_ids)
    return [tokens[i] for i in ids], time.perf_counter() - t0


def peer_checkpoint(model: str, tmp_path_factory) -> str:
    from tiny_models import make_checkpoint

    if PEER_MODELS[model] is None:
        return os.path.join(os.path.dirname(__file__), "..", "livemoe", "train", "assets", "student")
    path, _ = make_checkpoint(tmp_path_factory.mktemp("bench_peer") / "moe", moe=True, **PEER_MODELS[model])
    return path


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU comparison with llama.cpp")
@pytest.mark.skipif(llamacpp_peer.available() is not None, reason=str(llamacpp_peer.available()))
@pytest.mark.parametrize("model", list(PEER_MODELS))
def test_decode_vs_llama_cpp(benchmark, bench_mode, bench_long, bench_threads, tmp_path_factory, model):
    from livemoe.engine.llm import LLM
    from livemoe.engine.model.gguf_export import export_gguf

    path = peer_checkpoint(model, tmp_path_factory)
    cases = [(b, dtype, threads) for b, dtype in (PEER_CASES_FULL if bench_mode == "full" else PEER_CASES_QUICK)
             for threads in bench_threads]
    # --benchmark: 32 new tokens (~2 minutes for both models on 2 shared cores); --benchmark-full: 64
    new, prompt_len = (64 if bench_long else 32, 32) if bench_mode == "full" else (8, 16)
    reps = 3 if bench_mode == "full" else 1
    out_dir = tmp_path_factory.mktemp("gguf")
    threads_before = torch.get_num_threads()
    try:
        for dtype in dict.fromkeys(d for _, d, _ in cases):
            gguf = export_gguf(path, str(out_dir / f"{dtype}.gguf"), dtype)
            llm = LLM(path, dtype=torch.float32 if dtype == "f32" else torch.float16, device="cpu",
                      max_num_seqs=64, num_kv_blocks=64 * ((prompt_len + new) // 16 + 2), use_tqdm=False)
            vocab = llm.model.config.vocab_size
            for threads in dict.fromkeys(t for _, d, t in cases if d == dtype):
                torch.set_num_threads(threads)
                peer = llamacpp_peer.LlamaCppPeer(gguf, threads, n_seq=64, n_ctx_per_seq=prompt_len + new + 8,
                                                  kv_f16=dtype == "f16")  # llama.cpp's defaults: what is timed
                # the tokens are checked without its flash attention, which rounds f32 q/k/v to f16
                exact = llamacpp_peer.LlamaCppPeer(gguf, threads, n_seq=64, n_ctx_per_seq=prompt_len + new + 8,
                                                   flash_attn=False) if dtype == "f32" else peer
                try:
                    for batch in [b for b, d, t in cases if d == dtype and t == threads]:
                        prompts = random_prompts(batch, prompt_len, prompt_len, vocab, seed=batch)
                        ours_tokens, _ = ours_greedy_decode(llm, prompts, new)  # also the warm-up
                        peer_tokens, _ = (exact if dtype == "f32" else peer).greedy(prompts, new)
                        common = [common_prefix(a, b) for a, b in zip(ours_tokens, peer_tokens)]
                        if dtype == "f32":  # fp32 both sides: the same tokens, or a near-tie where they part
                            gaps = tie_gaps(llm.model, prompts, ours_tokens, peer_tokens, common)
                            assert max(gaps, default=0.0) <= PEER_TIE, (
                                f"{model} f32 batch {batch}: greedy tokens differ from llama.cpp's where ours are not "
                                f"near-tied (logit gaps {gaps}, common prefixes {common})")
                        if (batch, dtype, threads) == cases[0]:
                            benchmark.pedantic(lambda: ours_greedy_decode(llm, prompts, new), rounds=1, iterations=1)
                        t_ours, _, t_peer, _ = median_pair(lambda: ours_greedy_decode(llm, prompts, new)[::-1],
                                                           lambda: peer.greedy(prompts, new)[::-1], reps)
                        tokens = batch * (new - 1)
                        record(suite=SUITE, case=f"{model}, {dtype}, {threads} thread(s), batch {batch}",
                               metric="decode tok/s", ours=tokens / t_ours, baseline=tokens / t_peer,
                               baseline_name="llama.cpp (llama-cpp-python)", higher_is_better=True,
                               extra={"ours_s": t_ours, "baseline_s": t_peer,
                                      "greedy_common_prefix_mean": sum(common) / batch,
                                      "new_tokens": new, "prompt_len": prompt_len})
                finally:
                    peer.close()
                    exact.close()
            llm.close()
    finally:
        torch.set_num_threads(threads_before)
