"""Group-normalised advantages (group / batch / none scaling, zero-variance groups) and the multi-turn
turn- and trajectory-level credit, against plain per-group loops."""
import pytest
import torch

from livemoe.train.advantages import group_advantages, multi_turn_advantages, token_advantages


def loop_reference(rewards, K, scale, eps):
    out = []
    all_std = torch.tensor(rewards).std().item()
    for g in range(0, len(rewards), K):
        grp = torch.tensor(rewards[g:g + K], dtype=torch.float64)
        mean, std = grp.mean().item(), grp.std().item()  # unbiased, as TRL
        div = {"group": std + eps, "batch": all_std + eps, "none": 1.0}[scale]
        out += [(r - mean) / div for r in grp.tolist()]
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
@pytest.mark.parametrize("K", [2, 3, 8])
def test_group_advantages_match_a_loop(scale, K):
    g = torch.Generator().manual_seed(K)
    rewards = torch.rand(5 * K, generator=g).tolist()
    adv, keep, stats = group_advantages(rewards, K, scale, eps=1e-4)
    # fp32 vs an fp64 loop: rewards in [0, 1], advantages of order 1
    torch.testing.assert_close(adv.double(), loop_reference(rewards, K, scale, 1e-4), atol=1e-5, rtol=1e-5)
    assert keep.all() and stats["zero_variance_groups"] == 0 and stats["num_groups"] == 5
    grouped = adv.view(-1, K)
    assert grouped.mean(1).abs().max() < 1e-5  # centred within each group


def test_zero_variance_groups_are_counted_and_optionally_dropped():
    rewards = [1.0, 1.0, 1.0, 0.2, 0.5, 0.9, 0.0, 0.0, 0.0]
    adv, keep, stats = group_advantages(rewards, 3)
    assert stats["zero_variance_groups"] == 2
    assert keep.all()
    assert adv[:3].abs().max() == 0 and adv[6:].abs().max() == 0
    _, keep, stats = group_advantages(rewards, 3, drop_zero_variance=True)
    assert keep.tolist() == [False] * 3 + [True] * 3 + [False] * 3


@pytest.mark.parametrize("bad, match", [(([1.0, 2.0, 3.0], 2), "group_size"), (([1.0, float("nan")], 2), "NaN"),
                                        (([1.0, 2.0], 2, "std"), "scale_rewards"), (([1.0, 2.0], 0), "group_size")])
def test_group_advantages_reject_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        group_advantages(*bad)


def test_multi_turn_turn_level_credit_compares_the_same_turn_across_the_group():
    # group of 2 trajectories, 3 turns; trajectory 0 wins turn 0, loses turn 2
    turn_rewards = [[1.0, 0.5, 0.0], [0.0, 0.5, 1.0]]
    adv = multi_turn_advantages(turn_rewards, 2, turn_weight=1.0, eps=0.0)
    s = torch.tensor([1.0, 0.0]).std().item()
    assert adv[0] == pytest.approx([0.5 / s, 0.0, -0.5 / s])
    assert adv[1] == pytest.approx([-0.5 / s, 0.0, 0.5 / s])
    # the trajectory means are equal: pure trajectory-level credit gives nothing
    assert multi_turn_advantages(turn_rewards, 2, turn_weight=0.0, eps=0.0) == [[0.0] * 3, [0.0] * 3]


def test_multi_turn_combines_turn_and_trajectory_credit_by_weight():
    g = torch.Generator().manual_seed(0)
    K, T = 4, 3
    turn_rewards = torch.rand(2 * K, T, generator=g).tolist()
    at = multi_turn_advantages(turn_rewards, K, turn_weight=1.0)
    aj = multi_turn_advantages(turn_rewards, K, turn_weight=0.0)
    mix = multi_turn_advantages(turn_rewards, K, turn_weight=0.3)
    for i in range(2 * K):
        assert mix[i] == pytest.approx([0.3 * a + 0.7 * b for a, b in zip(at[i], aj[i])])
        assert len(set(aj[i])) == 1  # trajectory credit is one number per trajectory
    traj = [sum(t) / T for t in turn_rewards]
    ref, _, _ = group_advantages(traj, K)
    assert [a[0] for a in aj] == pytest.approx(ref.tolist())


def test_multi_turn_ragged_trajectories():
    # trajectory 1 has one turn only: turn 1 is compared between trajectories 0 and 2
    adv = multi_turn_advantages([[1.0, 1.0], [0.0], [1.0, 0.0]], 3, turn_weight=1.0, eps=0.0)
    assert len(adv[1]) == 1
    s = torch.tensor([1.0, 0.0]).std().item()
    assert adv[0][1] == pytest.approx(0.5 / s) and adv[2][1] == pytest.approx(-0.5 / s)
    with pytest.raises(ValueError, match="at least one"):
        multi_turn_advantages([[1.0], []], 2)


def test_token_advantages_mask_everything_but_assistant_turns():
    adv, mask = token_advantages([(2, 5), (8, 10)], [0.5, -1.0], 12)
    assert mask.tolist() == [0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0, 0]
    assert adv.tolist() == [0, 0, 0.5, 0.5, 0.5, 0, 0, 0, -1, -1, 0, 0]
    with pytest.raises(ValueError, match="overlaps"):
        token_advantages([(2, 5), (4, 6)], [1.0, 1.0], 8)
    with pytest.raises(ValueError, match="outside"):
        token_advantages([(2, 9)], [1.0], 8)
