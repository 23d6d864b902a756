"""Offline replay of ngram speculation over the demo's greedy answers: how many steps an answer takes and what they
cost in decode steps, without the engine's timing noise.

The committed student answers held-out product questions greedily (batch 1 output, no speculation); then each answer
is replayed step by step: the proposer drafts from the sequence so far, the drafts kept are those equal to the
answer's next tokens, plus the target's own token (what greedy verification does). The engine's backoff (a sequence
whose drafts keep failing waits 1, 2, 4 ... 16 steps) can be on or off. A verification costs `--verify-cost` decode
steps (bench_spec.py's test_verify_forward_cost measures it).

    PYTHONPATH=$PWD python -m bench.spec_replay --answers 60 --verify-cost 1.5
"""
import argparse
import types

import torch

from livemoe.engine.decoder.spec.proposers import NgramProposer
from livemoe.engine.decoder.spec.speculator import MAX_BACKOFF

K = 4  # num_speculative_tokens, as bench_spec


def greedy_answers(n: int, seed: int = 2_000_003) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of the committed student on n held-out rooms (bench_spec's step-cost prompts)."""
    from livemoe.engine import LLM
    from livemoe.engine.sampling.params import SamplingParams
    from livemoe.train.config import DEFAULT_STUDENT
    from livemoe.train.data import build_prompt
    from livemoe.train.synthetic.world import make_rooms

    llm = LLM(DEFAULT_STUDENT, num_kv_blocks=4096, use_tqdm=False, dtype=torch.float32, device="cpu")
    prompts = [build_prompt(r, llm.tokenizer) for r in make_rooms(n, seed=seed, prefix="eval")]
    return [(o.prompt_token_ids, o.outputs[0].token_ids)
            for p in prompts for o in llm.generate([p], SamplingParams(temperature=0, max_tokens=64))]


def replay(proposer: NgramProposer, answers, verify_cost: float, backoff: bool) -> dict:
    """Steps and decode-step cost per answer, over the tokens after the first (the prefill gives that one)."""
    steps = cost = tokens = verifications = kept = 0
    for prompt, out in answers:
        seq, i, misses, wait = list(prompt) + [out[0]], 1, 0, 0
        while i < len(out):
            drafts = []
            if wait:
                wait -= 1
            else:
                drafts = proposer.lookup(seq, min(K, len(out) - i - 1))
            a = 0
            while a < len(drafts) and drafts[a] == out[i + a]:
                a += 1
            if drafts:
                verifications, kept, cost = verifications + 1, kept + a, cost + verify_cost
                misses = 0 if a else misses + 1
                if not a and backoff:
                    wait = min(MAX_BACKOFF, 2 ** (misses - 1))
            else:
                cost += 1
            n = min(a + 1, len(out) - i)
            seq += out[i:i + n]
            i, steps = i + n, steps + 1
        tokens += len(out) - 1
        proposer.finished(types.SimpleNamespace(token_ids=seq, num_prompt_tokens=len(prompt),
                                                num_output_tokens=len(out)))
    n = len(answers)
    return {"tokens": tokens / n, "steps": steps / n, "cost": cost / n, "speedup": tokens / cost,
            "acceptance_length": (kept + verifications) / verifications if verifications else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--answers", type=int, default=60)
    ap.add_argument("--verify-cost", type=float, default=1.5)
    args = ap.parse_args()
    torch.set_num_threads(1)
    answers = greedy_answers(args.answers)
    print("| ngram | backoff | steps per answer | decode-step cost | speedup in forward cost | acceptance length |")
    print("|---|---|---:|---:|---:|---:|")
    for name, (lo, hi, recent) in {"from 2-token matches": (2, 5, 0), "from 1-token matches": (1, 5, 0),
                                   "1-token matches + 64 recent outputs": (1, 5, 64)}.items():
        for backoff in (True, False):
            r = replay(NgramProposer(lo, hi, recent), answers, args.verify_cost, backoff)
            print(f"| {name} | {'on' if backoff else 'off'} | {r['steps']:.2f} (of {r['tokens']:.2f} tokens) | "
                  f"{r['cost']:.2f} | {r['speedup']:.2f}x | {r['acceptance_length']:.2f} |")


if __name__ == "__main__":
    main()
