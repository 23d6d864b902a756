"""livemoe.train.losses against plain fp32 formulas (logits -> log_softmax -> gather -> loss), written per
sequence from TRL's documented definitions, and the behaviours the GRPO trainer relies on.

Tolerance 1e-5 relative on loss, metrics and gradients: both sides are fp32 and differ only in
summation order (the fused log-probs against the materialised log_softmax).
"""
import math

import pytest
import torch

from livemoe.train.losses import PolicyLossConfig, make_policy_loss_config, policy_loss, sft_loss

B, T, H, V = 4, 9, 12, 97


def rel_err(x, ref):
    return ((x - ref).abs().max() / ref.abs().max().clamp(min=1e-30)).item()


def batch(seed=0, perturb=0.3):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, H, generator=g).requires_grad_()
    weight = (torch.randn(V, H, generator=g) / H ** 0.5).requires_grad_()
    targets = torch.randint(0, V, (B, T), generator=g)
    mask = torch.ones(B, T)
    mask[0, 6:] = 0
    mask[2, 3:] = 0
    mask[3, :] = 0  # a sequence with no completion token at all
    with torch.no_grad():
        cur = torch.log_softmax(hidden @ weight.t(), -1).gather(-1, targets[..., None]).squeeze(-1)
    old = cur + perturb * torch.randn(B, T, generator=g)  # ratios on both sides of the clip range
    ref = cur + 0.2 * torch.randn(B, T, generator=g)
    adv = torch.randn(B, generator=g)
    return hidden, weight, targets, mask, old, ref, adv


def reference_loss(logp, old, adv, mask, ref, cfg: PolicyLossConfig, num_items=None):
    """Per-sequence loops over the documented formulas."""
    seq_losses, token_sum, n_tok = [], 0.0, mask.sum()
    clip_low = clip_high = ratio_sum = kl_sum = 0.0
    count = 0
    for i in range(B):
        m = mask[i].bool()
        a = adv[i] if adv.dim() == 1 else adv[i][m]
        lr = logp[i][m] - old[i][m]
        if cfg.importance_sampling_level == "sequence":
            w = torch.exp(lr.sum() / max(1, int(m.sum()))).expand(lr.shape)
        else:
            w = torch.exp(lr)
        clipped = torch.clamp(w, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
        first = w if cfg.delta is None else torch.clamp(w, max=cfg.delta)
        per_tok = -torch.minimum(first * a, clipped * a)
        if cfg.beta:
            d = ref[i][m] - logp[i][m]
            kl = torch.exp(d) - d - 1
            per_tok = per_tok + cfg.beta * kl
            kl_sum = kl_sum + kl.detach().sum()
        seq_losses.append(per_tok.sum() / max(1, int(m.sum())))
        token_sum = token_sum + per_tok.sum()
        low = (w < 1 - cfg.epsilon_low) & (a < 0)
        high = (w > 1 + cfg.epsilon_high) & (a > 0)
        if cfg.importance_sampling_level == "sequence":  # counted once per sequence
            sw = torch.exp(torch.tensor(0.0) + (lr.sum() / max(1, int(m.sum()))))
            clip_low += float((sw < 1 - cfg.epsilon_low) & (adv[i] < 0))
            clip_high += float((sw > 1 + cfg.epsilon_high) & (adv[i] > 0))
            ratio_sum += sw.detach()
            count += 1
        else:
            clip_low += low.sum().item()
            clip_high += high.sum().item()
            ratio_sum = ratio_sum + w.detach().sum()
            count += int(m.sum())
    gas = cfg.gradient_accumulation_steps
    if cfg.loss_type == "grpo":
        loss = torch.stack(seq_losses).mean() / gas
    elif cfg.loss_type == "bnpo":
        loss = token_sum / n_tok / gas
    elif cfg.loss_type == "dr_grpo":
        loss = token_sum / (B * (cfg.max_completion_length or T)) / gas
    else:
        loss = token_sum / (n_tok if num_items is None else num_items)
    metrics = {"clip_ratio/low_mean": clip_low / count, "clip_ratio/high_mean": clip_high / count,
               "clip_ratio/region_mean": (clip_low + clip_high) / count, "ratio/mean": float(ratio_sum) / count}
    if cfg.beta:
        metrics["kl"] = float(kl_sum) / float(n_tok)
    return loss, metrics


def fused_logprobs(hidden, weight, targets, mask):
    from livemoe.kernels.logprobs import fused_linear_logprobs

    return fused_linear_logprobs(hidden, weight, targets, mask=mask.bool())


def eager_logprobs(hidden, weight, targets, mask):
    return torch.log_softmax(hidden.float() @ weight.float().t(), -1).gather(-1, targets[..., None]).squeeze(-1)


CONFIGS = [dict(loss_type=lt) for lt in ("grpo", "bnpo", "dr_grpo", "dapo")] + [
    dict(loss_type="dr_grpo", max_completion_length=16),
    dict(loss_type="bnpo", beta=0.04, epsilon_high=0.28),
    dict(loss_type="grpo", delta=1.5, beta=0.01),
    dict(loss_type="grpo", importance_sampling_level="sequence", epsilon_low=3e-4, epsilon_high=4e-4),
    dict(loss_type="dapo", importance_sampling_level="sequence", epsilon_low=0.05, epsilon_high=0.1, beta=0.02),
    dict(loss_type="bnpo", gradient_accumulation_steps=3),
]


@pytest.mark.parametrize("options", CONFIGS, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_policy_loss_matches_formulas(options):
    hidden, weight, targets, mask, old, ref, adv = batch()
    cfg = PolicyLossConfig(**options)
    loss, metrics = policy_loss(fused_logprobs(hidden, weight, targets, mask), old, adv, mask, ref_logprobs=ref,
                                config=cfg)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    rloss, rmetrics = reference_loss(eager_logprobs(hidden, weight, targets, mask), old, adv, mask, ref, cfg)
    rgh, rgw = torch.autograd.grad(rloss, (hidden, weight))
    assert abs(loss.item() - rloss.item()) <= 1e-5 * max(1e-3, abs(rloss.item()))
    assert rel_err(gh, rgh) <= 1e-5 and rel_err(gw, rgw) <= 1e-5
    assert set(rmetrics) <= set(metrics)
    for k, v in rmetrics.items():
        assert metrics[k].requires_grad is False
        assert abs(metrics[k].item() - v) <= 1e-5 * max(1.0, abs(v)), k


def test_both_clip_branches_run():
    hidden, weight, targets, mask, old, ref, adv = batch(perturb=0.5)
    _, m = policy_loss(fused_logprobs(hidden, weight, targets, mask), old, adv, mask)
    assert m["clip_ratio/low_mean"] > 0 and m["clip_ratio/high_mean"] > 0


def test_on_policy_ratio_is_exactly_one():
    hidden, weight, targets, mask, _, _, adv = batch()
    for on_policy_old in (False, True):
        logp = fused_logprobs(hidden, weight, targets, mask)
        old = logp.detach() if on_policy_old else None
        loss, m = policy_loss(logp, old, adv, mask, epsilon_low=0.0, epsilon_high=0.0)
        assert m["ratio/mean"].item() == 1.0 and m["clip_ratio/region_mean"].item() == 0.0
        # on-policy the grpo loss is minus the mean advantage over sequences with tokens
        has = mask.sum(1) > 0
        expected = -(adv * has).sum() / B
        assert abs(loss.item() - expected.item()) <= 1e-6
        # and its gradient is the policy gradient, not zero: clip(1, 1, 1) must not cut it
        (g,) = torch.autograd.grad(loss, hidden)
        assert g[has].abs().sum() > 0


def test_clipped_tokens_get_zero_gradient():
    logp = torch.zeros(2, 4, requires_grad=True)
    old = torch.tensor([[-0.5, 0.5, 0.0, -0.1], [0.5, -0.5, 0.0, 0.1]])  # ratios e^{0.5}, e^{-0.5}, 1, ...
    adv = torch.tensor([1.0, -1.0])  # row 0: A > 0, row 1: A < 0
    mask = torch.ones(2, 4)
    loss, m = policy_loss(logp, old, adv, mask, loss_type="bnpo")
    (g,) = torch.autograd.grad(loss, logp)
    # row 0, token 0: ratio e^0.5 > 1.2 with A > 0 -> clipped high; row 1, token 0: e^-0.5 < 0.8 with A < 0
    assert g[0, 0] == 0 and g[1, 0] == 0
    # ratio on the other side of the range keeps its gradient (min picks the unclipped term)
    assert g[0, 1] != 0 and g[1, 1] != 0 and g[0, 2] != 0 and g[1, 3] != 0
    assert m["clip_ratio/high_mean"].item() == pytest.approx(1 / 8)
    assert m["clip_ratio/low_mean"].item() == pytest.approx(1 / 8)


def test_dual_clip_caps_negative_advantages():
    logp = torch.zeros(1, 3, requires_grad=True)
    old = torch.tensor([[-2.0, -0.1, 0.0]])  # ratio e^2 > delta=3, e^0.1, 1
    adv = torch.tensor([-1.0])
    loss, _ = policy_loss(logp, old, adv, torch.ones(1, 3), loss_type="bnpo", delta=3.0)
    (g,) = torch.autograd.grad(loss, logp)
    assert g[0, 0] == 0 and g[0, 1] != 0
    expected = (3.0 + math.exp(0.1) + 1.0) / 3  # -(-delta), -(-r), -(-1), averaged
    assert loss.item() == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_gradient_accumulation_equals_one_big_batch(loss_type):
    """dapo with num_items_in_batch = the active tokens of all micro-batches (and grpo with equal
    micro-batch sizes) summed over micro-batches equals the loss and gradient of one big batch."""
    hidden, weight, targets, mask, old, ref, adv = batch(perturb=0.4)
    big, _ = policy_loss(fused_logprobs(hidden, weight, targets, mask), old, adv, mask, loss_type=loss_type, beta=0.05,
                         ref_logprobs=ref)
    big_g = torch.autograd.grad(big, (hidden, weight))
    total = torch.zeros(())
    grads = [torch.zeros_like(hidden), torch.zeros_like(weight)]
    for sl in (slice(0, 2), slice(2, 4)):
        logp = fused_logprobs(hidden[sl], weight, targets[sl], mask[sl])
        loss, _ = policy_loss(logp, old[sl], adv[sl], mask[sl], ref_logprobs=ref[sl], beta=0.05, loss_type=loss_type,
                              gradient_accumulation_steps=2, num_items_in_batch=mask.sum() if loss_type == "dapo" else None)
        for acc, g in zip(grads, torch.autograd.grad(loss, (hidden, weight))):
            acc += g
        total = total + loss.detach()
    assert abs(total.item() - big.item()) <= 1e-6 * max(1.0, abs(big.item()))
    assert rel_err(grads[0], big_g[0]) <= 1e-5 and rel_err(grads[1], big_g[1]) <= 1e-5


def test_token_level_advantages_and_entropy_metric():
    hidden, weight, targets, mask, old, ref, adv = batch()
    adv_bt = adv[:, None].expand(B, T).clone()
    logp = fused_logprobs(hidden, weight, targets, mask)
    entropy = torch.rand(B, T)
    a, ma = policy_loss(logp, old, adv, mask, entropy=entropy)
    b, mb = policy_loss(logp, old, adv_bt, mask, entropy=entropy)
    assert torch.equal(a, b)
    assert ma["entropy"].item() == pytest.approx(((entropy * mask).sum() / mask.sum()).item())


@pytest.mark.parametrize("option,value", [
    ("loss_type", "ppo"), ("importance_sampling_level", "turn"), ("epsilon_low", 1.5), ("epsilon_high", -0.1),
    ("beta", -1.0), ("delta", 1.1), ("max_completion_length", 0), ("gradient_accumulation_steps", 0),
    ("beta", float("nan")),
])
def test_bad_options_name_the_option(option, value):
    with pytest.raises(ValueError, match=option):
        make_policy_loss_config(**{option: value})


def test_bad_calls():
    x = torch.zeros(2, 3)
    with pytest.raises(ValueError, match="unknown policy loss option"):
        policy_loss(x, x, torch.zeros(2), x, epsilon=0.2)
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(x, x, torch.zeros(2), x, beta=0.1)
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(x, x, torch.zeros(3), x)
    with pytest.raises(ValueError, match="num_items_in_batch"):
        policy_loss(x, x, torch.zeros(2), x, loss_type="dapo", gradient_accumulation_steps=4)


def test_sft_loss_weighted_completion_only():
    hidden, weight, targets, mask, *_ = batch()
    targets = torch.where(mask.bool(), targets, -100)
    token_weights = torch.ones(B, T)
    token_weights[0, 2] = 5.0  # a decision-marker token weighs more
    loss = sft_loss(hidden, weight, targets, token_weights)
    gh, gw = torch.autograd.grad(loss, (hidden, weight))
    keep = targets != -100
    nll = -eager_logprobs(hidden, weight, targets.clamp(min=0), mask)
    w = token_weights * keep
    ref = (nll * w).sum() / w.sum()
    rgh, rgw = torch.autograd.grad(ref, (hidden, weight))
    assert abs(loss.item() - ref.item()) <= 1e-5 * abs(ref.item())
    assert rel_err(gh, rgh) <= 1e-5 and rel_err(gw, rgw) <= 1e-5
    assert (gh[~keep] == 0).all()


def test_sft_loss_without_target_tokens_is_a_clear_error():
    hidden, weight, targets, *_ = batch()
    with pytest.raises(ValueError, match="no target token"):
        sft_loss(hidden, weight, torch.full_like(targets, -100))
    with pytest.raises(ValueError, match="no target token"):
        sft_loss(hidden, weight, targets, torch.zeros(B, T))


@pytest.mark.parametrize("level", ["token", "sequence"])
def test_log_ratio_is_clamped_before_exp_and_counted(level):
    from livemoe.train.losses import LOG_RATIO_CLAMP

    old = torch.zeros(2, 3)
    logprobs = torch.tensor([[-0.1, 100.0, -0.2], [-0.3, -0.1, -0.2]], requires_grad=True)  # one corrupt token
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    ref = torch.full((2, 3), -200.0)  # a KL log ratio far beyond the clamp too
    loss, m = policy_loss(logprobs, old, torch.tensor([-1.0, 1.0]), mask, ref_logprobs=ref, beta=0.1,
                          epsilon_low=0.2, epsilon_high=1e9, importance_sampling_level=level)
    assert torch.isfinite(loss)  # exp(100) is inf in fp32: with A < 0 the unclamped loss is inf
    assert m["log_ratio/clamped"].item() == 1  # the one token (at sequence level: its sequence, mean 100/3 > 10)
    assert m["ratio/mean"].item() < math.exp(LOG_RATIO_CLAMP)
    loss.backward()
    assert torch.isfinite(logprobs.grad).all()
