"""Speculative decoding (ngram prompt lookup) against the same engine without it, in the same process, run
alternately (full mode: median of 3 of each side; quick: one).

Workloads, each at batch 1 (16 requests one after the other), 8 and 64 (the first b prompts at once):
- demo answers: the committed student (livemoe/train/assets/student) answering held-out rooms' product questions
  (the RFT demo's prompts: the room's product list, then the question), greedy, up to 64 tokens, ending at EOS.
  The student is the RFT demo's starting point, not an RFT-trained checkpoint (training one here would cost
  minutes of CPU); its answers copy the fact from the product list as the RFT student's do.
- live session: bench_live's sessions (the small random MoE, the tests' byte-level tokenizer), decision latency
  per interval at 1 and 8 sessions.
- random control: the tiny random MoE on random prompts (lookup finds little), greedy, 32 tokens.
Rows: tokens/s (ours = with speculation), ms per output token and the mean acceptance length (extra).
Goal (issue 37): >= 2x tokens/s at batch 1 on the demo answers; never below 0.95x at batch 64 or on the control.
On a GPU the same suites run on the GPU (fp32; a verification step runs eagerly: no CUDA graph for its shape yet).
"""
import pytest
import torch

from bench.common import median_pair, record

SUITE = "spec_decode"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # on a GPU (bench/gpu_check.sh) the same rows, eager verify
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}


def _generate(llm, prompts, params):
    """Batch 1: the prompts one after the other (each alone in the engine); else all at once."""
    import time

    before = llm.stats()
    t0 = time.perf_counter()
    outs = [o for p in prompts for o in llm.generate([p], params)] if BATCH_ONE[0] else llm.generate(prompts, params)
    dt = time.perf_counter() - t0
    after = llm.stats()
    tokens = sum(len(o.token_ids) for o in outs)
    verifications = after.get("spec_num_verifications", 0) - before.get("spec_num_verifications", 0)
    accepted = after.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)
    return dt, (tokens, [o.token_ids for o in outs], (accepted + verifications) / verifications if verifications
                else None)


BATCH_ONE = [False]


def _compare(case, base, spec, prompts, params, reps):
    for batch in (1, 8, 64):
        ps = prompts[:16] if batch == 1 else prompts[:batch]  # batch 1: 16 requests in turn
        BATCH_ONE[0] = batch == 1
        t_spec, (n_spec, ids_spec, accept), t_base, (n_base, ids_base, _) = median_pair(
            lambda: _generate(spec, ps, params), lambda: _generate(base, ps, params), reps)
        # greedy: the same tokens (speculation is exact), so the same count on both sides
        assert n_spec == n_base, (n_spec, n_base)
        same = ids_spec == ids_base
        record(suite=SUITE, case=f"{case}, batch {batch}", metric="tok/s", ours=n_spec / t_spec,
               baseline=n_base / t_base, baseline_name="no speculation", higher_is_better=True,
               extra={"ms_per_token": 1e3 * t_spec / n_spec * batch, "baseline_ms_per_token":
                      1e3 * t_base / n_base * batch, "mean_acceptance_length": accept, "output_tokens": n_spec,
                      "same_tokens": same, "requests": len(ps)})


def test_demo_answers(bench_mode, one_thread):
    from livemoe.engine import LLM
    from livemoe.engine.sampling.params import SamplingParams
    from livemoe.train.config import DEFAULT_STUDENT
    from livemoe.train.data import build_prompt
    from livemoe.train.synthetic.world import make_rooms

    opts = dict(num_kv_blocks=4096, use_tqdm=False, dtype=torch.float32, device=DEVICE)
    base, spec = LLM(DEFAULT_STUDENT, **opts), LLM(DEFAULT_STUDENT, speculative_config=NGRAM, **opts)
    rooms = make_rooms(64, seed=1_000_003, prefix="eval")
    prompts = [build_prompt(r, base.tokenizer) for r in rooms]
    params = SamplingParams(temperature=0, max_tokens=64)
    base.generate(prompts[:8], params)  # warm-up
    spec.generate(prompts[:8], params)
    _compare("demo answers (committed student, greedy)", base, spec, prompts, params,
             3 if bench_mode == "full" else 1)


def test_random_control(bench_mode, one_thread, tmp_path_factory):
    from bench.bench_decode import random_prompts
    from livemoe.engine import LLM
    from livemoe.engine.sampling.params import SamplingParams
    from tiny_models import make_checkpoint

    path, _ = make_checkpoint(tmp_path_factory.mktemp("bench_spec") / "m", moe=True)
    opts = dict(num_kv_blocks=4096, use_tqdm=False, dtype=torch.float32, device=DEVICE)
    base, spec = LLM(path, **opts), LLM(path, speculative_config=NGRAM, **opts)
    prompts = random_prompts(64, 16, 48, 131, seed=3)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    base.generate(prompts[:8], params)
    spec.generate(prompts[:8], params)
    _compare("random control (tiny MoE, random prompts)", base, spec, prompts, params,
             3 if bench_mode == "full" else 1)


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
        lambda: _play(spec, num_sessions, warm, timed), lambda: _play(base, num_sessions, warm, timed),
        3 if bench_mode == "full" else 1)
    s = spec.stats()
    record(suite=SUITE, case=f"live session, {num_sessions} session(s)", metric="ms per interval",
           ours=t_spec * 1e3, baseline=t_base * 1e3, baseline_name="no speculation",
           extra={"completion_tokens": out, "baseline_completion_tokens": out_base,
                  "mean_acceptance_length": s["spec_mean_acceptance_length"]})
