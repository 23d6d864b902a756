"""GRPO advantages: rewards of the K rollouts of each prompt, normalised within the group.

    A_i = (r_i - mean_group) / (std + eps)
scale_rewards (TRL's names): "group" divides by the group's std, "batch" by the std of all rewards of
the batch, "none" only centres (Dr. GRPO). std is the unbiased one (TRL's). A group whose rewards are
all equal (zero variance) carries no signal: it is counted, and optionally dropped (its rollouts get
keep = False and leave the loss).

Multi-turn (LiveAssistant's streaming GSPO): a trajectory holds several assistant turns, each with
its own reward. Turn-level credit normalises the rewards of turn t across the K trajectories of the
group (they answer the same stream at the same point); trajectory-level credit normalises each
trajectory's mean turn reward across the group. A turn's advantage is
    turn_weight * A_turn + (1 - turn_weight) * A_trajectory,
spread on that turn's tokens; every other token (prompt, user / stream turns) has completion_mask 0.
"""
import torch

SCALE_REWARDS = ("group", "batch", "none")
ZERO_STD = 1e-6  # a group whose std is below this is "zero variance" (rewards equal up to fp noise)


def _check(rewards, group_size, scale_rewards, eps):
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps!r}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive int, got {group_size!r}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [num_prompts * group_size] with group_size={group_size}, "
                         f"got shape {tuple(rewards.shape)}")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards contain NaN or inf")


def group_advantages(rewards, group_size: int, scale_rewards: str = "group", eps: float = 1e-4,
                     drop_zero_variance: bool = False):
    """rewards [N*K] (group i = rows i*K .. i*K+K-1) -> (advantages [N*K], keep [N*K] bool, stats dict).

    stats: zero_variance_groups (count), num_groups, reward_std_group (mean over groups)."""
    rewards = torch.as_tensor(rewards, dtype=torch.float32)
    _check(rewards, group_size, scale_rewards, eps)
    grouped = rewards.view(-1, group_size)
    mean = grouped.mean(1, keepdim=True)
    std = grouped.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    centred = grouped - mean
    if scale_rewards == "group":
        adv = centred / (std + eps)
    elif scale_rewards == "batch":
        batch_std = rewards.std() if rewards.numel() > 1 else rewards.new_zeros(())
        adv = centred / (batch_std + eps)
    else:
        adv = centred
    zero = std.squeeze(1) < ZERO_STD
    adv = torch.where(zero[:, None], torch.zeros_like(adv), adv)  # equal rewards: no signal (and no 0/0 at eps=0)
    keep = (~zero if drop_zero_variance else torch.ones_like(zero)).repeat_interleave(group_size)
    stats = {"zero_variance_groups": int(zero.sum()), "num_groups": grouped.shape[0],
             "reward_std_group": float(std.mean())}
    return adv.reshape(-1), keep, stats


def _normalise(values: list, scale: bool, eps: float) -> list:
    t = torch.tensor(values, dtype=torch.float32)
    if t.numel() < 2:
        return [0.0] * len(values)  # a lone sample has nothing to be compared with
    c = t - t.mean()
    std = t.std()
    if std < ZERO_STD:
        return [0.0] * len(values)
    return (c / (std + eps) if scale else c).tolist()


def multi_turn_advantages(turn_rewards: list, group_size: int, turn_weight: float = 0.5, eps: float = 1e-4,
                          scale_rewards: str = "group", trajectory_rewards: list | None = None) -> list:
    """turn_rewards: per trajectory a list of per-turn rewards (groups of group_size consecutive
    trajectories) -> per trajectory a list of per-turn advantages.

    trajectory_rewards: one reward per trajectory (default: the mean of its turn rewards).
    scale_rewards "group" / "batch" divide by the group's std ("batch" = the whole batch's for the
    trajectory term), "none" only centres."""
    if not 0.0 <= turn_weight <= 1.0:
        raise ValueError(f"turn_weight must be in [0, 1], got {turn_weight!r}")
    if scale_rewards not in SCALE_REWARDS:
        raise ValueError(f"scale_rewards must be one of {SCALE_REWARDS}, got {scale_rewards!r}")
    if len(turn_rewards) % group_size:
        raise ValueError(f"{len(turn_rewards)} trajectories do not split into groups of {group_size}")
    if any(len(t) == 0 for t in turn_rewards):
        raise ValueError("every trajectory needs at least one assistant turn with a reward")
    if trajectory_rewards is None:
        trajectory_rewards = [sum(t) / len(t) for t in turn_rewards]
    if len(trajectory_rewards) != len(turn_rewards):
        raise ValueError("trajectory_rewards must have one reward per trajectory")
    traj_adv, _, _ = group_advantages(torch.tensor(trajectory_rewards, dtype=torch.float32), group_size,
                                      scale_rewards, eps)
    out = []
    for g in range(0, len(turn_rewards), group_size):
        group = turn_rewards[g:g + group_size]
        per_turn = [[0.0] * len(t) for t in group]
        for t in range(max(len(x) for x in group)):
            members = [i for i, x in enumerate(group) if t < len(x)]
            adv = _normalise([group[i][t] for i in members], scale_rewards != "none", eps)
            for i, a in zip(members, adv):
                per_turn[i][t] = a
        for i, turns in enumerate(per_turn):
            a_traj = float(traj_adv[g + i])
            out.append([turn_weight * a + (1.0 - turn_weight) * a_traj for a in turns])
    return out


def token_advantages(turn_spans: list, turn_advantages: list, length: int):
    """Spreads per-turn advantages on tokens: turn_spans [(start, end)] of assistant tokens (end
    exclusive) in a sequence of `length` tokens -> (advantages [length], completion_mask [length]);
    tokens outside every span get advantage 0 and mask 0."""
    if len(turn_spans) != len(turn_advantages):
        raise ValueError(f"{len(turn_spans)} turn spans but {len(turn_advantages)} turn advantages")
    adv = torch.zeros(length)
    mask = torch.zeros(length)
    for (s, e), a in zip(turn_spans, turn_advantages):
        if not 0 <= s <= e <= length:
            raise ValueError(f"turn span ({s}, {e}) outside a sequence of {length} tokens")
        if mask[s:e].any():
            raise ValueError(f"turn span ({s}, {e}) overlaps another turn")
        adv[s:e] = a
        mask[s:e] = 1.0
    return adv, mask
