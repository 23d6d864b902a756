"""Training losses on top of the fused log-probs: completion-only SFT cross-entropy and the GRPO family
of clipped policy losses (GRPO, BNPO, Dr. GRPO, DAPO; token- or sequence-level (GSPO) ratios).

The policy loss follows TRL's GRPOTrainer as documented (loss_type, importance_sampling_level,
delta, epsilon_low / epsilon_high, beta), per token t of completion i:
    log_ratio = logprobs - old_logprobs
    token level:    w_i,t = exp(log_ratio_i,t)
    sequence level: w_i   = exp(sum_t mask * log_ratio / max(1, |o_i|))        (GSPO)
    l_i,t = -min(min(w, delta) * A, clip(w, 1 - epsilon_low, 1 + epsilon_high) * A) + beta * KL_i,t
    KL_i,t = exp(ref - logp) - (ref - logp) - 1                                   (k3 estimator)
and the aggregation over the completion mask:
    grpo    mean over sequences of each sequence's token mean           / gradient_accumulation_steps
    bnpo    sum over tokens / number of active tokens in this batch     / gradient_accumulation_steps
    dr_grpo sum over tokens / (B * max_completion_length)               / gradient_accumulation_steps
    dapo    sum over tokens / num_items_in_batch (active tokens of the whole accumulated batch)
so summing the losses of the micro-batches of one optimizer step gives the step's loss. Log ratios (and the
KL's) are clamped to ±10 before exp(), as torchtitan does, so one stale token cannot overflow a step; the
clamps are counted ("log_ratio/clamped"). delta (TRL's
two-sided clip) is the dual clip c for negative advantages: with delta > 1 + epsilon_high it changes
only tokens with A < 0 and w > delta, whose loss becomes -delta * A with no gradient.
"""
import dataclasses
import math
from dataclasses import dataclass

import torch

from livemoe.kernels.logprobs import fused_linear_logprobs

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
LOG_RATIO_CLAMP = 10.0  # |log ratio| beyond this is clamped before exp(), as torchtitan does
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")


@dataclass(frozen=True, kw_only=True, slots=True)
class PolicyLossConfig:
    beta: float = 0.0  # k3 KL weight; 0 = no reference pass
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None  # dual clip c (TRL's two-sided `delta`); must exceed 1 + epsilon_high
    importance_sampling_level: str = "token"  # "sequence" = GSPO (use its small epsilons, e.g. 3e-4 / 4e-4)
    loss_type: str = "grpo"
    max_completion_length: int | None = None  # dr_grpo's constant; None = the batch's T
    gradient_accumulation_steps: int = 1

    def __post_init__(self):
        def bad(name, why):
            raise ValueError(f"policy loss option {name}={getattr(self, name)!r}: {why}")

        def number(name):
            x = getattr(self, name)
            if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
                bad(name, "must be a finite number")
            return x

        if number("beta") < 0:
            bad("beta", "must be >= 0")
        if not 0 <= number("epsilon_low") < 1:
            bad("epsilon_low", "must be in [0, 1)")
        if number("epsilon_high") < 0:
            bad("epsilon_high", "must be >= 0")
        if self.delta is not None and number("delta") <= 1 + self.epsilon_high:
            bad("delta", f"must be > 1 + epsilon_high = {1 + self.epsilon_high}")
        if self.importance_sampling_level not in IMPORTANCE_SAMPLING_LEVELS:
            bad("importance_sampling_level", f"must be one of {IMPORTANCE_SAMPLING_LEVELS}")
        if self.loss_type not in LOSS_TYPES:
            bad("loss_type", f"must be one of {LOSS_TYPES}")
        if self.max_completion_length is not None and (
                not isinstance(self.max_completion_length, int) or self.max_completion_length < 1):
            bad("max_completion_length", "must be a positive int or None")
        if not isinstance(self.gradient_accumulation_steps, int) or self.gradient_accumulation_steps < 1:
            bad("gradient_accumulation_steps", "must be a positive int")


def make_policy_loss_config(config: PolicyLossConfig | None = None, **options) -> PolicyLossConfig:
    """A config from keyword options (over `config` when given); unknown names are a ValueError."""
    known = {f.name for f in dataclasses.fields(PolicyLossConfig)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"unknown policy loss option(s) {unknown}; known: {sorted(known)}")
    return PolicyLossConfig(**options) if config is None else dataclasses.replace(config, **options)


def _masked_mean(x, mask):
    """TRL's masked batch mean: sequence-level [B, 1] values average over sequences."""
    if x.shape[1] == 1:
        return x.mean()
    return (x * mask).sum() / mask.sum().clamp(min=1.0)


def policy_loss(logprobs, old_logprobs, advantages, completion_mask, *, ref_logprobs=None, entropy=None,
                num_items_in_batch=None, is_weights=None, config: PolicyLossConfig | None = None, **options):
    """Clipped policy-gradient loss of the GRPO family (see the module docstring for the formulas).

    logprobs [B, T] (differentiable, from fused_linear_logprobs), old_logprobs [B, T] or None (= the
    detached current values: on-policy, ratio exactly 1), advantages [B] or [B, T], completion_mask
    [B, T] (1 on completion tokens), ref_logprobs [B, T] (needed when beta > 0), entropy [B, T]
    (metric only). num_items_in_batch: dapo's normaliser, the active-token count of the whole
    accumulated batch (default: this batch's, allowed only when gradient_accumulation_steps == 1).
    is_weights [B, T]: rollout-correction weights (livemoe.train.mismatch) multiplying each token's policy
    term (not the KL's), as TIS does.
    Options are PolicyLossConfig's fields, given as `config=` and/or keywords (beta=, epsilon_low=,
    epsilon_high=, delta=, importance_sampling_level=, loss_type=, max_completion_length=,
    gradient_accumulation_steps=).

    Returns (loss, metrics): metrics are detached 0-d tensors (no host sync): "clip_ratio/low_mean",
    "clip_ratio/high_mean", "clip_ratio/region_mean", "ratio/mean", "log_ratio/clamped" (how many log ratios were
    beyond ±LOG_RATIO_CLAMP and clamped before exp(); the KL's log ratio is clamped alike, uncounted), and "kl"
    (beta > 0) and "entropy" (when given).
    """
    cfg = make_policy_loss_config(config, **options)
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be [B, T], got {tuple(logprobs.shape)}")
    shape = tuple(logprobs.shape)
    for name, x in (("old_logprobs", old_logprobs), ("completion_mask", completion_mask),
                    ("ref_logprobs", ref_logprobs), ("entropy", entropy), ("is_weights", is_weights)):
        if x is not None and tuple(x.shape) != shape:
            raise ValueError(f"{name} must have logprobs' shape {shape}, got {tuple(x.shape)}")
    if tuple(advantages.shape) not in ((shape[0],), shape):
        raise ValueError(f"advantages must be [B] = [{shape[0]}] or [B, T] = {list(shape)}, got {tuple(advantages.shape)}")
    if cfg.beta != 0.0 and ref_logprobs is None:
        raise ValueError(f"beta={cfg.beta} needs ref_logprobs (or set beta=0 to skip the reference)")
    if cfg.loss_type == "dapo" and num_items_in_batch is None and cfg.gradient_accumulation_steps > 1:
        raise ValueError("loss_type='dapo' with gradient accumulation needs num_items_in_batch "
                         "(the active-token count of all the accumulated micro-batches)")

    logprobs = logprobs.float()
    mask = completion_mask.float()
    old = logprobs.detach() if old_logprobs is None else old_logprobs.float()
    adv = advantages.float()
    adv = adv.unsqueeze(1) if adv.dim() == 1 else adv

    log_ratio = logprobs - old
    if cfg.importance_sampling_level == "token":
        log_weights = log_ratio
    else:
        log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    # one stale or corrupt token must not overflow exp() and end a run: clamped (no gradient there) and counted
    clamped = (log_weights.detach().abs() > LOG_RATIO_CLAMP) * (mask if log_weights.shape == mask.shape else 1.0)
    coef_1 = torch.exp(log_weights.clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    coef_2 = torch.clamp(coef_1, 1 - cfg.epsilon_low, 1 + cfg.epsilon_high)
    unclipped = coef_1 if cfg.delta is None else torch.clamp(coef_1, max=cfg.delta)
    per_token_loss = -torch.min(unclipped * adv, coef_2 * adv)
    if is_weights is not None:
        per_token_loss = per_token_loss * is_weights.detach().float()
    per_token_kl = None
    if cfg.beta != 0.0:
        diff = (ref_logprobs.float() - logprobs).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
        per_token_kl = torch.exp(diff) - diff - 1
        per_token_loss = per_token_loss + cfg.beta * per_token_kl

    if cfg.loss_type == "grpo":
        loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif cfg.loss_type == "bnpo":
        loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
    elif cfg.loss_type == "dr_grpo":
        length = cfg.max_completion_length or shape[1]
        loss = (per_token_loss * mask).sum() / (per_token_loss.shape[0] * length)
    else:  # dapo: already normalised over the whole accumulated batch
        normalizer = mask.sum().clamp(min=1.0) if num_items_in_batch is None else num_items_in_batch
        loss = (per_token_loss * mask).sum() / normalizer
    if cfg.loss_type != "dapo":
        loss = loss / cfg.gradient_accumulation_steps

    with torch.no_grad():
        is_low = (coef_1 < 1 - cfg.epsilon_low) & (adv < 0)  # clipped: these get no gradient
        is_high = (coef_1 > 1 + cfg.epsilon_high) & (adv > 0)
        metrics = {
            "clip_ratio/low_mean": _masked_mean(is_low.float(), mask),
            "clip_ratio/high_mean": _masked_mean(is_high.float(), mask),
            "clip_ratio/region_mean": _masked_mean((is_low | is_high).float(), mask),
            "ratio/mean": _masked_mean(coef_1, mask),
            "log_ratio/clamped": clamped.sum(),  # a count (tokens, or sequences at sequence level): sum, not mean
        }
        if per_token_kl is not None:
            metrics["kl"] = _masked_mean(per_token_kl, mask)
        if entropy is not None:
            metrics["entropy"] = _masked_mean(entropy.float(), mask)
    return loss, metrics


def sft_loss(hidden, weight, targets, token_weights=None, *, temperature: float = 1.0, ignore_index: int = -100,
             normalizer=None, **logprob_options):
    """Weighted completion-only cross-entropy through the fused log-probs.

    hidden [..., H] (already aligned with targets: position t predicts targets[t]), weight [V, H],
    targets [...] with ignore_index on prompt / padding positions, token_weights [...] (default 1; e.g.
    extra weight on decision-marker tokens). loss = sum(w * -logprob) / sum(w) over the non-ignored
    tokens, or / normalizer when given (e.g. the total weight of all accumulated micro-batches).
    Raises ValueError when no token carries weight (a host sync, once per call).
    """
    if token_weights is not None and tuple(token_weights.shape) != tuple(targets.shape):
        raise ValueError(f"token_weights {tuple(token_weights.shape)} must have the targets' shape {tuple(targets.shape)}")
    logprobs = fused_linear_logprobs(hidden, weight, targets, temperature, ignore_index=ignore_index, **logprob_options)
    w = (targets != ignore_index).float()
    if token_weights is not None:
        if not torch.isfinite(token_weights).all() or (token_weights < 0).any():
            raise ValueError("token_weights must be finite and >= 0")
        w = w * token_weights.float()
    total = w.sum()
    if normalizer is None:
        if not total > 0:
            raise ValueError("sft_loss: no target token has weight (every target is ignore_index, or all "
                             "token_weights are 0): check the completion mask of this batch")
        normalizer = total
    return -(logprobs * w).sum() / normalizer
