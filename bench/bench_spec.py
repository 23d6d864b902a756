"""Speculative decoding (ngram prompt lookup) against the same engine without it, in the same process, run
alternately (full mode: median of 5 of each side, 3 for the live session; quick: one).

Workloads, each at batch 1 (16 requests one after the other), 8 and 64 (b prompts at once); each rep runs its own
prompts (the same on both sides), so the recent-outputs lookup never meets a question it has answered:
- demo answers: the committed student (livemoe/train/assets/student) answering held-out rooms' product questions
  (the RFT demo's prompts: the room's product list, then the question), greedy, up to 64 tokens, ending at EOS;
  with prompt lookup from 2-token matches (the engine's default), from 1-token ones, and with lookup_recent_outputs
  too (the answers share a template).
  The student is the RFT demo's starting point, not an RFT-trained checkpoint (training one here would cost
  minutes of CPU); its answers copy the fact from the product list as the RFT student's do.
- live session: bench_live's sessions (the small random MoE, the tests' byte-level tokenizer), decision latency
  per interval at 1 and 8 sessions.
- random control: the tiny random MoE on random prompts (lookup finds little), greedy, 32 tokens.
Rows: tokens/s (ours = with speculation), ms per output token and the mean acceptance length (extra).
Goal (issue 37): >= 2x tokens/s at batch 1 on the demo answers; never below 0.95x at batch 64 or on the control.
On a GPU (bench/gpu_check.sh) the same suites run there (fp32), decode and verification steps on CUDA graphs (the
rows' extra says how many verification steps replayed one).
"""

import dataclasses
import statistics

import pytest
import torch

from bench.common import median_pair, record

SUITE = "spec_decode"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU (bench/gpu_check.sh) the same rows
# 1-token matches too: the demo's answers copy single words (a product's name, its attribute) from the question
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 5}
RECENT = {"lookup_recent_outputs": 64}


def _generate(llm, prompts, params):
    """Batch 1: the prompts one after the other (each alone in the engine); else all at once."""
    import time

    before = llm.stats()
    t0, c0 = time.perf_counter(), time.process_time()
    outs = [o for p in prompts for o in llm.generate([p], params)] if BATCH_ONE[0] else llm.generate(prompts, params)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0
    after = llm.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    verifications = after.get("spec_num_verifications", 0) - before.get("spec_num_verifications", 0)
    accepted = after.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)
    return dt, (
        tokens,
        [o.token_ids for o in outs],
        (accepted + verifications) / verifications if verifications else None,
        cpu,
    )


BATCH_ONE = [False]
BATCHES = (1, 8, 64)
BATCH_ONE_REQUESTS = 16  # batch 1: this many requests in turn


def _compare(case, base, spec, prompt_sets, params, warm):
    """prompt_sets {batch: [the prompts of each rep]}: ours and the baseline alternate, each rep on its own prompts
    (both sides the same), so a speculator that keeps earlier outputs (lookup_recent_outputs) never drafts an
    answer from an earlier run of the same question. Each batch size is first run once untimed on both sides, on
    the warm-up prompts (the first step at a new batch size costs more)."""
    for batch, sets in prompt_sets.items():
        BATCH_ONE[0] = batch == 1
        for llm in (spec, base):
            _generate(llm, (warm * batch)[: len(sets[0])], params)
        todo, current = iter(sets), [None]
        cpu: tuple[list, list] = ([], [])

        def timed(llm, side):
            dt, result = _generate(llm, current[0], params)
            cpu[side].append(result[-1])
            return dt, result

        def ours():
            current[0] = next(todo)
            return timed(spec, 0)

        t_spec, (n_spec, ids_spec, accept, _), t_base, (n_base, ids_base, _, _) = median_pair(
            ours, lambda: timed(base, 1), len(sets)
        )
        # greedy: the same tokens (speculation is exact), so the same count on both sides
        assert n_spec == n_base, (n_spec, n_base)
        same = ids_spec == ids_base
        record(
            suite=SUITE,
            case=f"{case}, batch {batch}",
            metric="tok/s",
            ours=n_spec / t_spec,
            baseline=n_base / t_base,
            baseline_name="no speculation",
            higher_is_better=True,
            extra={
                "ms_per_token": 1e3 * t_spec / n_spec * batch,
                "baseline_ms_per_token": 1e3 * t_base / n_base * batch,
                "mean_acceptance_length": accept,
                "output_tokens": n_spec,
                "same_tokens": same,
                "requests": len(current[0]),
                # CPU seconds of this process (the engine runs in it), less moved by other load than wall time
                "cpu_time_speedup": statistics.median(cpu[1]) / statistics.median(cpu[0]),
                "verify_graph_replays": spec.stats()["num_verify_graph_replays"],
            },
        )


def _split(prompts: list, reps: int) -> dict:
    """Disjoint prompt lists per batch and rep, in order."""
    out, i = {}, 0
    for batch in BATCHES:
        n = BATCH_ONE_REQUESTS if batch == 1 else batch
        out[batch] = [prompts[i + r * n : i + (r + 1) * n] for r in range(reps)]
        i += reps * n
    assert i <= len(prompts)
    return out


def test_demo_answers(bench_mode, one_thread):
    from livemoe.engine import LLM
    from livemoe.engine.sampling.params import SamplingParams
    from livemoe.train.config import DEFAULT_STUDENT
    from livemoe.train.data import build_prompt
    from livemoe.train.synthetic.world import make_rooms

    reps = 5 if bench_mode == "full" else 1
    opts = dict(num_kv_blocks=4096, use_tqdm=False, dtype=torch.float32, device=DEVICE)
    base = LLM(DEFAULT_STUDENT, **opts)
    configs = {
        ", lookup from 2 tokens": NGRAM | {"prompt_lookup_min": 2},
        "": NGRAM,
        ", recent outputs": NGRAM | RECENT,
    }
    if bench_mode != "full":  # the smoke run: one configuration
        configs = {", recent outputs": NGRAM | RECENT}
    specs = {name: LLM(DEFAULT_STUDENT, speculative_config=c, **opts) for name, c in configs.items()}
    warm, per_rep = 8, BATCH_ONE_REQUESTS + sum(BATCHES[1:])
    rooms = make_rooms(warm + len(specs) * reps * per_rep, seed=1_000_003, prefix="eval")
    prompts = [build_prompt(r, base.tokenizer) for r in rooms]
    params = SamplingParams(temperature=0, max_tokens=64)
    for i, (name, spec) in enumerate(specs.items()):  # each its own prompts: the baseline's prefix cache is shared
        mine = prompts[warm + i * reps * per_rep : warm + (i + 1) * reps * per_rep]
        _compare(
            f"demo answers (committed student, greedy{name})", base, spec, _split(mine, reps), params, prompts[:warm]
        )


def _time_steps(llm, totals: dict) -> None:
    """Adds each engine step's forward CPU seconds to totals[kind] (prefill, decode, verify)."""
    import time

    runner = llm.core.runner
    run = runner.run

    def timed_run(out):
        kind = "verify" if any(s.num_draft_tokens for s in out.seqs) else "decode" if out.is_decode_only else "prefill"
        t0 = time.process_time()
        result = run(out)
        totals[kind] = totals.get(kind, 0.0) + time.process_time() - t0
        return result

    runner.run = timed_run


def test_demo_step_costs(bench_mode, one_thread):
    """Where a batch-1 request's CPU time goes, with and without speculation (ngram from 1-token matches, recent
    outputs): the prefill, decode and verification forwards, the rest of the engine's steps, and the request in all;
    16 requests in turn per rep, the two sides alternating on the same new questions."""
    import time

    from livemoe.engine import LLM
    from livemoe.engine.sampling.params import SamplingParams
    from livemoe.train.config import DEFAULT_STUDENT
    from livemoe.train.data import build_prompt
    from livemoe.train.synthetic.world import make_rooms

    reps = 5 if bench_mode == "full" else 1
    opts = dict(num_kv_blocks=4096, use_tqdm=False, dtype=torch.float32, device=DEVICE)
    base = LLM(DEFAULT_STUDENT, **opts)
    spec = LLM(DEFAULT_STUDENT, speculative_config=NGRAM | RECENT, **opts)
    rooms = make_rooms(8 + reps * BATCH_ONE_REQUESTS, seed=2_000_003, prefix="eval")
    prompts = [build_prompt(r, base.tokenizer) for r in rooms]
    params = SamplingParams(temperature=0, max_tokens=64)
    for llm in (base, spec):
        for p in prompts[:8]:
            llm.generate([p], params)
    totals: tuple[dict, dict] = ({}, {})
    for side, llm in enumerate((base, spec)):
        _time_steps(llm, totals[side])
    tokens = [0, 0]
    for r in range(reps):
        todo = prompts[8 + r * BATCH_ONE_REQUESTS : 8 + (r + 1) * BATCH_ONE_REQUESTS]
        for side in (0, 1) if r % 2 == 0 else (1, 0):
            t0 = time.process_time()
            for p in todo:
                tokens[side] += len((base, spec)[side].generate([p], params)[0].token_ids)
            totals[side]["request"] = totals[side].get("request", 0.0) + time.process_time() - t0
    assert tokens[0] == tokens[1], tokens  # greedy: the same tokens
    n = reps * BATCH_ONE_REQUESTS
    for side in totals:
        forward = sum(side.get(k, 0.0) for k in ("prefill", "decode", "verify"))
        side["rest of the engine"] = side["request"] - forward
    for kind in ("prefill", "decode", "verify", "rest of the engine", "request"):
        record(
            suite=SUITE,
            case=f"demo answers, batch 1, CPU time per request: {kind}",
            metric="ms",
            ours=1e3 * totals[1].get(kind, 0.0) / n,
            baseline=1e3 * totals[0].get(kind, 0.0) / n,
            baseline_name="no speculation",
            higher_is_better=False,
            extra={"requests": n, "ours": "ngram from 1-token matches, recent outputs"},
        )
    # tokens per CPU second over the whole request (prefill included), and over decoding only (TPOT-based, as
    # llama.cpp's TG figure: the output tokens after the first, over the request's CPU time less its prefill step)
    whole = [tokens[s] / totals[s]["request"] for s in (0, 1)]
    decode = [(tokens[s] - n) / (totals[s]["request"] - totals[s]["prefill"]) for s in (0, 1)]
    for case, (b, o) in (("whole request", whole), ("decode only (TPOT)", decode)):
        record(
            suite=SUITE,
            case=f"demo answers, batch 1, tok/s per CPU second, {case}",
            metric="tok/s",
            ours=o,
            baseline=b,
            baseline_name="no speculation",
            higher_is_better=True,
            extra={"requests": n, "output_tokens": tokens[1], "ours": "ngram from 1-token matches, recent outputs"},
        )


_STEP_TENSORS = ("slot_mapping", "context_lens", "block_tables", "cu_seqlens_q")


def caught_steps() -> dict:
    """{query rows: (call, input_ids, positions, step)}: the first one-call CPU step (livemoe::decode_step) of each
    row count the engine ran while answering 4 demo questions with ngram speculation (1-token decode steps and
    5-token verifications among them), to be replayed alone with fused_decode.run_step."""
    from livemoe.engine import LLM
    from livemoe.engine.model import fused_decode
    from livemoe.engine.sampling.params import SamplingParams
    from livemoe.train.config import DEFAULT_STUDENT
    from livemoe.train.data import build_prompt
    from livemoe.train.synthetic.world import make_rooms

    spec = LLM(
        DEFAULT_STUDENT, speculative_config=NGRAM, num_kv_blocks=4096, use_tqdm=False, dtype=torch.float32, device="cpu"
    )
    caught: dict = {}
    real = fused_decode.run_step

    def catch(call, input_ids, positions, step):
        if input_ids.shape[1] not in caught:  # the CPU runner's step inputs are views of buffers the next step reuses
            kept = dataclasses.replace(step, **{n: t.clone() for n in _STEP_TENSORS if (t := getattr(step, n)) is not None})
            caught[input_ids.shape[1]] = (call, input_ids.clone(), positions.clone(), kept)
        return real(call, input_ids, positions, step)

    fused_decode.run_step = catch
    try:
        for room in make_rooms(4, seed=4_000_003, prefix="eval"):
            spec.generate([build_prompt(room, spec.tokenizer)], SamplingParams(temperature=0, max_tokens=64))
    finally:
        fused_decode.run_step = real
    assert 1 in caught and 5 in caught, sorted(caught)
    return caught


def test_verify_forward_cost(bench_mode, one_thread):
    """A 5-token verification forward against a 1-token decode forward of the committed student on the demo's
    prompts, both the one-call CPU step (livemoe::decode_step) at ~210 tokens of context, replayed in isolation
    (the engine's own calls, caught in a run), alternated, CPU time; and the paged attention inside them alone, the
    one op whose cost grows with the query rows most. The ratio is what a verification costs in decode steps."""
    import time

    from livemoe.engine.model import fused_decode

    if DEVICE != "cpu" or not fused_decode.BUILT:
        pytest.skip("the one-call CPU step (livemoe._C on the CPU)")
    caught = caught_steps()
    real = fused_decode.run_step
    calls = 200 if bench_mode == "full" else 20

    def timer(fn):
        def timed():
            t0 = time.process_time()
            for _ in range(calls):
                fn()
            return (time.process_time() - t0) / calls, None

        return timed

    def step_of(n):
        call, ids, pos, step = caught[n]
        return lambda: real(call, ids, pos, step)

    def attention_of(n):
        call, _, _, step = caught[n]
        k_cache, v_cache = step.kv_caches[call.cache_index[0]]
        q = torch.randn(n, call.num_heads, k_cache.shape[-1])
        return lambda: torch.ops.livemoe.paged_attention(
            q, k_cache, v_cache, None if n == 1 else step.cu_seqlens_q, step.context_lens, step.block_tables, call.scale
        )

    reps = 7 if bench_mode == "full" else 1
    with torch.inference_mode():
        for what, make in (("forward (decode_step)", step_of), ("paged attention, one layer", attention_of)):
            t5, _, t1, _ = median_pair(timer(make(5)), timer(make(1)), reps)
            record(
                suite=SUITE,
                case=f"verification of 4 drafts against a decode step: {what}",
                metric="us",
                ours=t5 * 1e6,
                baseline=t1 * 1e6,
                baseline_name="decode step (1 token)",
                higher_is_better=False,
                extra={"context_tokens": int(caught[5][3].context_lens[0]), "calls": calls, "ratio": t5 / t1},
            )


def test_random_control(bench_mode, one_thread, tmp_path_factory):
    from bench.bench_decode import random_prompts
    from livemoe.engine import LLM
    from livemoe.engine.sampling.params import SamplingParams
    from tiny_models import make_checkpoint

    path, _ = make_checkpoint(tmp_path_factory.mktemp("bench_spec") / "m", moe=True)
    opts = dict(num_kv_blocks=4096, use_tqdm=False, dtype=torch.float32, device=DEVICE)
    reps = 5 if bench_mode == "full" else 1
    base, spec = LLM(path, **opts), LLM(path, speculative_config=NGRAM | RECENT, **opts)
    prompts = random_prompts(8 + reps * (BATCH_ONE_REQUESTS + sum(BATCHES[1:])), 16, 48, 131, seed=3)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    _compare(
        "random control (tiny MoE, random prompts, recent outputs)",
        base,
        spec,
        _split(prompts[8:], reps),
        params,
        prompts[:8],
    )


@pytest.mark.parametrize("num_sessions", [1, 8])
def test_live_session(bench_mode, one_thread, tmp_path_factory, num_sessions):
    from bench.bench_live import SMALL, _play
    from livemoe.engine import LLM
    from tiny_tokenizer import make_text_checkpoint

    size = SMALL if bench_mode == "full" else {"max_position_embeddings": 4096}
    path, _ = make_text_checkpoint(tmp_path_factory.mktemp("bench_spec_live") / "m", moe=True, **size)
    opts = dict(device=DEVICE, num_kv_blocks=4096, use_tqdm=False)
    base, spec = LLM(path, **opts), LLM(path, speculative_config=NGRAM, **opts)
    warm, timed = (6, 4) if bench_mode == "full" else (2, 1)
    t_spec, (_, _, out), t_base, (_, _, out_base) = median_pair(
        lambda: _play(spec, num_sessions, warm, timed),
        lambda: _play(base, num_sessions, warm, timed),
        3 if bench_mode == "full" else 1,
    )
    s = spec.stats()
    record(
        suite=SUITE,
        case=f"live session, {num_sessions} session(s)",
        metric="ms per interval",
        ours=t_spec * 1e3,
        baseline=t_base * 1e3,
        baseline_name="no speculation",
        extra={
            "completion_tokens": out,
            "baseline_completion_tokens": out_base,
            "mean_acceptance_length": s["spec_mean_acceptance_length"],
        },
    )


if __name__ == "__main__":
    # `perf record python -m bench.bench_spec ROWS CALLS`: replays the caught step of ROWS query rows (1: a decode
    # step, 5: a verification of 4 drafts) CALLS times, one thread, so a profile of each can be compared
    import sys
    import time

    from livemoe.engine.model import fused_decode

    torch.set_num_threads(1)
    rows, calls = int(sys.argv[1]), int(sys.argv[2])
    call, ids, pos, step = caught_steps()[rows]
    with torch.inference_mode():
        t0 = time.process_time()
        for _ in range(calls):
            fused_decode.run_step(call, ids, pos, step)
        print(f"{rows} rows: {(time.process_time() - t0) / calls * 1e6:.1f} us CPU per step")
