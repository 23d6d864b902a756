"""Live sessions: decision latency per interval with the session's cached context (pinned blocks, each
interval prefills only its new events) against re-prefilling the whole context every interval (the
same engine with prefix caching off), at 1, 8 and 32 concurrent sessions batched by step_sessions (on the CPU,
32 sessions and 12 warm-up intervals only with --benchmark-full; --benchmark warms up 6 and times 3).

CPU: the small random Qwen3-MoE of bench_decode with the tests' byte-level tokenizer; each session is
warmed up to a long context first, then the later intervals are timed (the ratio is what counts: both
sides run in the same process, alternately). Quick mode: the tiny model, 1 and 8 sessions, fewer
intervals. Measured here in quick mode (2-core shared CPU, ~820-token contexts, 67-token greedy
decisions on both sides): 1.2x at 1 session (decode-bound), 2.7x at 8.
On a GPU the same suite runs at the same sizes (bench/gpu_check.sh runs every suite).
"""

import itertools

import pytest
import torch

from bench.common import median_pair, play_live, record

SUITE = "live"
SMALL = dict(hidden_size=256, num_experts=32, num_experts_per_tok=4, moe_intermediate_size=128,
             num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4, head_dim=32,
             max_position_embeddings=4096)
SYSTEM = ("you are the live assistant of a shopping stream. products: link 3: pork zongzi. filling: pork. "
          "price: 39 yuan. link 7: clear case. color: red. price: 19 yuan. ") * 3
EVENTS = [[{"type": "comment", "user": "amy", "text": "how much is link 3?"}],
          [{"type": "join", "user": "bob"}, {"type": "frame", "text": "the host holds up the clear case"}],
          [{"type": "transcript", "text": "link 7 is now 29 yuan"}], []]


_plays = itertools.count()


def _play(llm, num_sessions: int, warm: int, timed: int) -> tuple:
    """play_live over num_sessions sessions of the shopping stream."""
    from livemoe.engine.live import LiveSession

    # a new system prompt each play, at its start: no play may hit blocks an earlier one left in the prefix cache.
    # greedy: both sides decide the same (up to float ties), so they decode the same number of tokens
    play = next(_plays)
    sessions = [LiveSession(llm, f"play {play}. " + SYSTEM + f" room {i}.", temperature=0.0, max_message_chars=32)
                for i in range(num_sessions)]
    return play_live(sessions, lambda i: EVENTS[i % len(EVENTS)], warm, timed)


@pytest.mark.parametrize("num_sessions", [1, 8, 32])
def test_live_decision_latency(benchmark, bench_mode, bench_long, tmp_path_factory, one_thread, num_sessions):
    from livemoe.engine import LLM
    from tiny_tokenizer import make_text_checkpoint

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # the long CPU cases (32 sessions, 12 warm-up intervals: ~10 minutes on 2 cores) are --benchmark-full's
    long = bench_mode == "full" and (bench_long or device == "cuda")
    if num_sessions > 8 and not long:
        pytest.skip("1 and 8 sessions on the CPU (pytest bench/ --benchmark-full runs 32)")
    size = SMALL if bench_mode == "full" else {"max_position_embeddings": 4096}  # quick: the tiny model
    path, _ = make_text_checkpoint(tmp_path_factory.mktemp("bench_live") / "m", moe=True, **size)
    warm, timed = (12, 6) if long else (6, 3) if bench_mode == "full" else (3, 1)
    reps = 3 if bench_mode == "full" else 1
    opts = dict(device=device, num_kv_blocks=4096, use_tqdm=False)
    cached, fresh = LLM(path, **opts), LLM(path, enable_prefix_caching=False, **opts)
    benchmark.pedantic(lambda: _play(cached, num_sessions, 1, 1), rounds=1, iterations=1)  # warm-up, its row
    t_ours, (prompt, hit, out), t_base, (_, _, out_base) = median_pair(
        lambda: _play(cached, num_sessions, warm, timed), lambda: _play(fresh, num_sessions, warm, timed), reps)
    record(suite=SUITE, case=f"{num_sessions} session(s), intervals {warm + 1}-{warm + timed} "
                             f"(~{prompt:.0f}-token context)",
           metric="ms per interval", ours=t_ours * 1e3, baseline=t_base * 1e3,
           baseline_name="re-prefill the whole context each interval",
           extra={"prompt_tokens": prompt, "cached_prompt_tokens": hit, "completion_tokens": out,
                  "baseline_completion_tokens": out_base})
    assert hit > 0.8 * prompt  # the cached side really served the context from the cache
