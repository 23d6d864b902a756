"""Held-out evaluation of a live policy: each session is played through an engine LiveSession (the
decoder, the decision grammar, the session's cached context), one interval at a time, and judged.

The row per stage is the seed's table: state, recipient and task accuracy (%), plus grounding (%),
the trajectory reward, the mean decision latency (ms per interval, one session at a time) and the
decode GFLOPs per interval (livemoe.engine.model.flops: 2 x active parameters x decision tokens)."""
import time

from livemoe.engine.live.session import LiveSession
from livemoe.train.live.data import interval_time
from livemoe.train.live.judge import accuracy, outcomes, score_session


def play(llm, session: dict, max_message_chars: int, temperature: float = 0.0, on_step=None) -> list:
    """The session's decisions, interval by interval. on_step(i, interval, decision) sees each."""
    decisions = []
    with LiveSession(llm, session["system"], max_message_chars=max_message_chars, temperature=temperature,
                     seed=0 if temperature > 0 else None) as live:
        for i, iv in enumerate(session["intervals"]):
            d = live.step(iv["events"], t=interval_time(iv, i))
            decisions.append(d)
            if on_step is not None:
                on_step(i, iv, d)
    return decisions


def evaluate(llm, sessions: list, max_message_chars: int, temperature: float = 0.0) -> dict:
    t0 = time.perf_counter()
    scores, latencies, flops, traj, prefilled, cached = [], [], [], [], 0, 0
    for s in sessions:
        decisions = play(llm, s, max_message_chars, temperature)
        sc = score_session(decisions, s)
        scores += sc.intervals
        traj.append(sc.trajectory_reward(len(decisions)))
        latencies += [d.metrics.latency_s for d in decisions]
        flops += [d.metrics.decode_flops for d in decisions]
        prefilled += sum(d.metrics.prompt_tokens - d.metrics.cached_prompt_tokens for d in decisions)
        cached += sum(d.metrics.cached_prompt_tokens for d in decisions)
    row = accuracy(scores)
    row.update(trajectory_reward=sum(traj) / len(traj), latency_ms=1000 * sum(latencies) / len(latencies),
               decode_gflops=sum(flops) / len(flops) / 1e9, cached_frac=cached / max(1, cached + prefilled),
               sessions=len(sessions), time_s=time.perf_counter() - t0, outcomes=outcomes(scores))
    return row
