"""bench/spec_replay.py's accounting: steps and decode-step cost of a replayed answer, for the oracle, a draft model's
greedy chain and ngram lookup, and the truncated student it drafts with."""

import json
import os

from bench.spec_replay import replay, replay_draft, truncated_student
from livemoe.engine.decoder.spec.proposers import NgramProposer

PROMPT = [5, 6, 7, 8, 9]
ANSWER = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30]  # 10 tokens after the first (which the prefill gives)


def oracle(answers):
    return [list(p[1:]) + list(o) + [-1] for p, o in answers]


def test_oracle_takes_ceil_of_tokens_over_k_plus_one_steps():
    answers = [(PROMPT, ANSWER)]
    r = replay_draft(oracle(answers), answers, verify_cost=1.5, draft_cost=0.0, k=4)
    assert r["steps"] == 2 and r["cost"] == 3.0 and r["tokens"] == 10  # 5 + 5 tokens
    assert r["speedup"] == 10 / 3.0 and r["acceptance_length"] == 5.0
    r = replay_draft(oracle(answers), answers, verify_cost=1.0, draft_cost=0.0, k=8)
    assert r["steps"] == 2 and r["cost"] == 2.0  # 9 + 1 tokens: the last step drafts nothing past the answer


def test_draft_cost_is_paid_per_draft_even_when_rejected():
    answers = [(PROMPT, ANSWER)]
    wrong = [[-5] * (len(PROMPT) + len(ANSWER))]
    r = replay_draft(wrong, answers, verify_cost=1.5, draft_cost=0.5, k=2)
    # every step: one token, its verification and its drafts (2, then 1 before the answer's end; none at the last)
    assert r["steps"] == 10 and r["acceptance_length"] == 1.0
    assert r["cost"] == 8 * (1.5 + 2 * 0.5) + (1.5 + 0.5) + 1.0


def test_ngram_copies_an_answer_found_in_the_prompt():
    answers = [(PROMPT + [1] + ANSWER + [2], ANSWER)]
    r = replay(NgramProposer(1, 5), answers, verify_cost=1.0, backoff=True, k=4)
    assert r["steps"] == 2 and r["cost"] == 2.0
    # with nothing to copy every lookup fails: plain decode steps, after the first misses' backoff
    r = replay(NgramProposer(1, 5), [(PROMPT, ANSWER)], verify_cost=1.5, backoff=True, k=4)
    assert r["steps"] == 10 and r["acceptance_length"] is None and r["cost"] == 10.0


def test_truncated_student_keeps_the_first_layers(tmp_path):
    from safetensors import safe_open

    path = truncated_student(1, str(tmp_path))
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == 1
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        layers = {k.split(".")[2] for k in f.keys() if k.startswith("model.layers.")}
        assert layers == {"0"} and "lm_head.weight" in f.keys() and "model.norm.weight" in f.keys()
    assert os.path.exists(os.path.join(path, "tokenizer.json"))
