"""Offline replay of speculation over the demo's greedy answers: how many steps an answer takes and what they cost in
decode steps, without the engine's timing noise.

The committed student answers held-out product questions greedily (batch 1 output, no speculation); then each answer
is replayed step by step: the proposer drafts from the sequence so far, the drafts kept are those equal to the
answer's next tokens, plus the target's own token (what greedy verification does). The engine's backoff (a sequence
whose drafts keep failing waits 1, 2, 4 ... 16 steps) can be on or off. A verification costs `--verify-cost` decode
steps (bench_spec.py's test_verify_forward_cost measures it).

Proposers replayed: an oracle (every draft is the answer's next token: the bound of any proposer at that k and
verification cost); ngram (prompt lookup) at several k and match lengths; draft_model with the student's first 1, 2
or 3 layers as the draft (a truncated copy: the same embeddings, final norm and head; its greedy chain, read
teacher-forced off one forward over prompt + answer, which is what it drafts wherever its earlier drafts were kept);
and ngram with the draft model where lookup finds nothing. A draft-model step costs k draft forwards (each
`draft cost` decode steps: by default measured here, the engine's forward CPU time per decode step of the truncated
model over the student's, alternated) plus the verification.

    PYTHONPATH=$PWD python -m bench.spec_replay --answers 60 --verify-cost 1.7 1.0
"""

import argparse
import json
import os
import shutil
import tempfile
import time
import types

import torch

from livemoe.engine.decoder.spec.proposers import NgramProposer
from livemoe.engine.decoder.spec.speculator import MAX_BACKOFF

K = 4  # num_speculative_tokens, as bench_spec
SEED = 2_000_003  # bench_spec's step-cost prompts


def _prompts(n: int, tokenizer) -> list[str]:
    from livemoe.train.data import build_prompt
    from livemoe.train.synthetic.world import make_rooms

    return [build_prompt(r, tokenizer) for r in make_rooms(n, seed=SEED, prefix="eval")]


def greedy_answers(n: int) -> list[tuple[list[int], list[int]]]:
    """(prompt ids, answer ids) of the committed student on n held-out rooms."""
    from livemoe.engine import LLM
    from livemoe.engine.sampling.params import SamplingParams
    from livemoe.train.config import DEFAULT_STUDENT

    llm = LLM(DEFAULT_STUDENT, num_kv_blocks=4096, use_tqdm=False, dtype=torch.float32, device="cpu")
    return [
        (o.prompt_token_ids, o.outputs[0].token_ids)
        for p in _prompts(n, llm.tokenizer)
        for o in llm.generate([p], SamplingParams(temperature=0, max_tokens=64))
    ]


def truncated_student(num_layers: int, out_dir: str) -> str:
    """The committed student's first num_layers layers (and its embeddings, final norm and head) as a checkpoint
    with its tokenizer: a draft that shares everything but depth."""
    from safetensors.torch import load_file, save_file

    from livemoe.train.config import DEFAULT_STUDENT

    path = os.path.join(out_dir, f"student_{num_layers}_layers")
    os.makedirs(path, exist_ok=True)
    for name in os.listdir(DEFAULT_STUDENT):
        if name not in ("model.safetensors", "config.json") and not os.path.isdir(os.path.join(DEFAULT_STUDENT, name)):
            shutil.copy(os.path.join(DEFAULT_STUDENT, name), path)
    with open(os.path.join(DEFAULT_STUDENT, "config.json")) as f:
        config = json.load(f)
    config["num_hidden_layers"] = num_layers
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    kept = {
        k: v
        for k, v in load_file(os.path.join(DEFAULT_STUDENT, "model.safetensors")).items()
        if not k.startswith("model.layers.") or int(k.split(".")[2]) < num_layers
    }
    save_file(kept, os.path.join(path, "model.safetensors"))
    return path


def draft_predictions(path: str, answers) -> list[list[int]]:
    """Per answer, the draft's greedy next token after each position of prompt + answer (teacher-forced, fp32)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.inference_mode():
        return [model(torch.tensor([list(p) + list(o)])).logits[0].argmax(-1).tolist() for p, o in answers]


def decode_step_cost(path: str, reference: str, requests: int = 12, reps: int = 5) -> float:
    """CPU time of one decode forward (the runner's run: plan + forward) of `path` over that of `reference`, both
    answering the same prompts greedily at batch 1, alternated; medians over reps."""
    from livemoe.engine import LLM
    from livemoe.engine.sampling.params import SamplingParams

    opts = dict(num_kv_blocks=4096, use_tqdm=False, dtype=torch.float32, device="cpu")
    llms = [LLM(p, **opts) for p in (path, reference)]
    prompts = _prompts(requests, llms[0].tokenizer)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    per_step: tuple[list, list] = ([], [])
    for llm in llms:
        llm.generate(prompts[:2], params)
    for r in range(reps):
        for side in (0, 1) if r % 2 == 0 else (1, 0):
            runner = llms[side].core.runner
            run, spent = runner.run, [0.0, 0]

            def timed(out, run=run, spent=spent):
                t0 = time.process_time()
                result = run(out)
                if out.is_decode_only:
                    spent[0], spent[1] = spent[0] + time.process_time() - t0, spent[1] + 1
                return result

            runner.run = timed
            for p in prompts:
                llms[side].generate([p], params)
            runner.run = run
            per_step[side].append(spent[0] / spent[1])
    per_step[0].sort()
    per_step[1].sort()
    return per_step[0][reps // 2] / per_step[1][reps // 2]


def replay(proposer: NgramProposer, answers, verify_cost: float, backoff: bool, k: int = K) -> dict:
    """ngram: steps and decode-step cost per answer, over the tokens after the first (the prefill gives that one)."""
    totals = []
    for prompt, answer in answers:
        totals.append(_replay(lambda seq, n: (proposer.lookup(seq, n), verify_cost), prompt, answer, backoff, k))
        proposer.finished(
            types.SimpleNamespace(
                token_ids=list(prompt) + list(answer), num_prompt_tokens=len(prompt), num_output_tokens=len(answer)
            )
        )
    return _summary(totals)


def replay_draft(
    predictions, answers, verify_cost: float, draft_cost: float, k: int, ngram: NgramProposer | None = None
) -> dict:
    """draft_model (its greedy chain, read off predictions) as the proposer: k draft forwards and a verification
    per step, no backoff (a draft model always drafts); with `ngram`, lookup first (a verification alone) and the
    draft model only where lookup finds nothing."""
    totals = []
    for (prompt, answer), pred in zip(answers, predictions):

        def propose(seq, n, pred=pred):
            found = ngram.lookup(seq, n) if ngram is not None else []
            if found:
                return found, verify_cost
            # draft j is the draft's choice after the answer's tokens up to it: where an earlier draft was not
            # kept, draft j no longer matters
            return pred[len(seq) - 1 : len(seq) - 1 + n], verify_cost + n * draft_cost

        totals.append(_replay(propose, prompt, answer, False, k))
        if ngram is not None:
            ngram.finished(
                types.SimpleNamespace(
                    token_ids=list(prompt) + list(answer), num_prompt_tokens=len(prompt), num_output_tokens=len(answer)
                )
            )
    return _summary(totals)


def _replay(propose, prompt, out, backoff: bool, k: int) -> dict:
    """One answer: propose(seq, n) gives at most n drafts after seq and what a step verifying them costs."""
    steps = cost = verifications = kept = 0
    seq, i, misses, wait = list(prompt) + [out[0]], 1, 0, 0
    while i < len(out):
        drafts, step_cost = [], 1.0
        if wait:
            wait -= 1
        else:
            drafts, step_cost = propose(seq, min(k, len(out) - i - 1))
        a = 0
        while a < len(drafts) and drafts[a] == out[i + a]:
            a += 1
        if drafts:
            verifications, kept = verifications + 1, kept + a
            misses = 0 if a else misses + 1
            if not a and backoff:
                wait = min(MAX_BACKOFF, 2 ** (misses - 1))
        cost += step_cost if drafts else 1.0
        n = min(a + 1, len(out) - i)
        seq += out[i : i + n]
        i, steps = i + n, steps + 1
    return {"tokens": len(out) - 1, "steps": steps, "cost": cost, "verifications": verifications, "kept": kept}


def _summary(totals: list[dict]) -> dict:
    """Per answer means; the speedup over one decode step per token; the mean acceptance length."""
    n, s = len(totals), {key: sum(t[key] for t in totals) for key in totals[0]}
    return {
        "tokens": s["tokens"] / n,
        "steps": s["steps"] / n,
        "cost": s["cost"] / n,
        "speedup": s["tokens"] / s["cost"],
        "acceptance_length": (s["kept"] + s["verifications"]) / s["verifications"] if s["verifications"] else None,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--answers", type=int, default=60)
    ap.add_argument("--verify-cost", type=float, nargs="+", default=[1.5], help="one table per value")
    ap.add_argument(
        "--draft-layers", type=int, nargs="*", default=[1, 2, 3], help="draft_model rows: the student's first N layers"
    )
    ap.add_argument("--draft-cost", type=float, nargs="*", help="their draft step costs (default: measured here)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    answers = greedy_answers(args.answers)
    # the bound of any proposer: every draft is the answer's next token
    oracle = [list(p[1:]) + list(o) + [-1] for p, o in answers]
    drafts = {}
    from livemoe.train.config import DEFAULT_STUDENT

    with tempfile.TemporaryDirectory() as tmp:
        for j, layers in enumerate(args.draft_layers):
            path = truncated_student(layers, tmp)
            cost = args.draft_cost[j] if args.draft_cost else decode_step_cost(path, DEFAULT_STUDENT)
            drafts[layers] = (draft_predictions(path, answers), cost)
    print(f"{sum(len(o) - 1 for _, o in answers) / len(answers):.2f} tokens per answer after its first")
    for v in args.verify_cost:
        print(f"\nverification = {v} decode steps\n")
        print(
            "| proposer | k | backoff | steps per answer | decode-step cost | speedup in forward cost | acceptance length |"
        )
        print("|---|---:|---|---:|---:|---:|---:|")

        def row(name, k, backoff, r):
            acc = f"{r['acceptance_length']:.2f}" if r["acceptance_length"] else "-"
            print(f"| {name} | {k} | {backoff} | {r['steps']:.2f} | {r['cost']:.2f} | {r['speedup']:.2f}x | {acc} |")

        for k in (4, 8):
            row("oracle (every draft kept)", k, "-", replay_draft(oracle, answers, v, 0.0, k))
        ngrams = {
            "ngram from 2-token matches": (2, 5, 0),
            "ngram from 1-token matches": (1, 5, 0),
            "ngram 1-token + 64 recent outputs": (1, 5, 64),
            "ngram 1-token + 64 recent, max 8": (1, 8, 64),
        }
        for name, (lo, hi, recent) in ngrams.items():
            for k in (2, 4, 8):
                for backoff in (True, False):
                    r = replay(NgramProposer(lo, hi, recent), answers, v, backoff, k)
                    row(name, k, "on" if backoff else "off", r)
        for layers, (preds, c) in drafts.items():
            for k in (1, 2, 4):
                name = f"draft_model: first {layers} layer(s), a draft step {c:.2f} decode steps"
                row(name, k, "-", replay_draft(preds, answers, v, c, k))
                r = replay_draft(preds, answers, v, c, k, NgramProposer(1, 5, 64))
                row(f"ngram (1-token + 64 recent), else the {layers}-layer draft", k, "-", r)
            name = f"draft_model: first {layers} layer(s) at no draft cost (acceptance alone)"
            row(name, K, "-", replay_draft(preds, answers, v, 0.0, K))


if __name__ == "__main__":
    main()
