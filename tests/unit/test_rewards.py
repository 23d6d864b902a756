"""The GRPO rewards: the seed's length reward on both sides of its interval and inside it (d as a
fraction of L_ref), the composite weights, MuSiQue's EM-only correctness, user reward functions."""
import random
import sys
import types

import pytest

from livemoe.train.judges import SquadJudge, Verdict
from livemoe.train.rewards import CompositeReward, RewardConfig, RewardError, length_reward, load_reward_fns


def reference_length_reward(lp, lr, up, lo, eps):
    """The seed's formula written out in tokens, then d / L_ref (the documented unit)."""
    L_upper, L_lower = up * lr, lo * lr
    if lp < L_lower:
        d = max(L_lower - lp, 0)
    elif lp > L_upper:
        d = max(lp - L_upper, 0)
    else:
        d = 0
    return max(0.0, 1 - (d / lr) / eps)


@pytest.mark.parametrize("policy_len, expected", [
    (40, 1.0), (45, 1.0), (50, 1.0),   # inside [0.4, 0.5] x 100 and on its ends
    (35, 0.5), (32, 0.2), (30, 0.0), (0, 0.0),   # below: 5 tokens short = half of ε = 10% of 100
    (55, 0.5), (58, 0.2), (60, 0.0), (400, 0.0),  # above
])
def test_length_reward_defaults_around_the_interval(policy_len, expected):
    assert length_reward(policy_len, 100) == pytest.approx(expected, abs=1e-12)


def test_length_reward_scales_with_the_reference_length():
    # d is a fraction of L_ref: the same relative miss gives the same reward at any scale
    for ref in (10, 100, 3000):
        assert length_reward(0.55 * ref, ref) == pytest.approx(0.5)
        assert length_reward(0.35 * ref, ref) == pytest.approx(0.5)


def test_length_reward_matches_the_formula_on_random_inputs():
    rng = random.Random(0)
    for _ in range(500):
        lr = rng.randint(1, 1000)
        lo = rng.uniform(0, 1)
        up = lo + rng.uniform(0, 1)
        eps = rng.uniform(0.01, 1)
        lp = rng.randint(0, 2 * lr)
        assert length_reward(lp, lr, up, lo, eps) == pytest.approx(reference_length_reward(lp, lr, up, lo, eps))


@pytest.mark.parametrize("args, match", [((10, 0), "ref_len"), ((-1, 10), "policy_len"),
                                         ((10, 10, 0.3, 0.4), "lambda_lower"), ((10, 10, 0.5, 0.4, 0), "epsilon")])
def test_length_reward_rejects_bad_input(args, match):
    with pytest.raises(RewardError, match=match):
        length_reward(*args)


class FixedJudge:
    def __init__(self, verdicts):
        self.verdicts = verdicts

    def judge_batch(self, records, completions):
        return self.verdicts[:len(records)]


def test_composite_reward_uses_the_seed_weights():
    recs = [{"id": str(i), "meta": {}} for i in range(4)]
    verdicts = [Verdict(True, True), Verdict(True, False), Verdict(False, True), Verdict(False, False)]
    out = CompositeReward(FixedJudge(verdicts))(recs, ["x"] * 4, [45, 45, 100, 55], [100] * 4)
    assert [r.reward for r in out] == pytest.approx([0.4 + 0.3 + 0.3, 0.4 + 0.3, 0.3 + 0.0, 0.3 * 0.5])
    assert out[3].components == {"correct": 0.0, "helpful": 0.0, "length": pytest.approx(0.5)}


def test_composite_reward_custom_weights():
    cfg = RewardConfig(w_correct=1.0, w_helpful=0.0, w_length=2.0, lambda_upper=0.8, lambda_lower=0.2)
    out = CompositeReward(FixedJudge([Verdict(True, True)]), cfg)([{"id": "a"}], ["x"], [50], [100])
    assert out[0].reward == pytest.approx(1.0 + 2.0)


def test_musique_uses_em_and_leaves_helpfulness_out():
    rec = {"id": "m", "meta": {"kind": "musique", "answers": ["Paris"]}, "reference": "Paris"}
    out = CompositeReward(SquadJudge())([rec, rec], ["<think>t</think>paris", "lyon"], [45, 45], [100, 100])
    assert "helpful" not in out[0].components
    assert out[0].reward == pytest.approx(0.4 + 0.3)  # EM 1 + length inside
    assert out[1].reward == pytest.approx(0.3)        # EM 0


def test_user_reward_functions_by_dotted_path(monkeypatch):
    mod = types.ModuleType("my_rewards")
    mod.polite = lambda record, completion, info: 1.0 if "please" in completion else 0.0
    mod.bad = lambda record, completion, info: "high"
    monkeypatch.setitem(sys.modules, "my_rewards", mod)
    assert [(n, w) for n, _, w in load_reward_fns("my_rewards:polite=0.5, my_rewards.polite")] == [("polite", 0.5), ("polite", 1.0)]
    cr = CompositeReward(FixedJudge([Verdict(False, False)] * 2), RewardConfig(reward_fns="my_rewards:polite=0.5"))
    out = cr([{"id": "a"}, {"id": "b"}], ["please", "no"], [0, 0], [100, 100])
    assert [r.reward for r in out] == pytest.approx([0.5, 0.0])
    assert out[0].components["polite"] == 1.0
    with pytest.raises(RewardError, match="not a number"):
        CompositeReward(FixedJudge([Verdict(False, False)]), RewardConfig(reward_fns="my_rewards:bad"))(
            [{"id": "a"}], ["x"], [1], [10])
    with pytest.raises(RewardError, match="cannot be imported"):
        load_reward_fns("my_rewards:missing")
    with pytest.raises(RewardError, match="'nodots=2': expected a dotted path"):
        load_reward_fns("nodots=2")
    with pytest.raises(RewardError, match="weight"):
        load_reward_fns("my_rewards:polite=heavy")
    with pytest.raises(RewardError, match="w_length"):
        RewardConfig(w_length=-1)
