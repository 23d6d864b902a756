"""Rollout-trainer mismatch: how far the decoder's log-probs and routing are from the trainer's, measured every
GRPO step (verl's rollout-correction metrics), and the rollout correction that weights the policy loss by their
ratio (truncated importance sampling, TIS) or leaves sequences out of it (rejection sampling, RS).

Per completion token, with d = logp_trainer - logp_rollout (the trainer's log-prob at the start of the step):
    |d|                               mean and max
    k3 KL(rollout || trainer)         exp(d) - d - 1, a token mean (the tokens were drawn from the rollout)
    perplexity ratio                  ppl_trainer / ppl_rollout = exp(-mean_t d), a mean over sequences
and per token and MoE layer, whether the trainer's own top-k expert set differs from the decoder's: the routing
disagreement is the share of tokens that differ in at least one layer, and per layer the share that differ there.

Rollout correction (--rollout_is token | sequence | none): the importance weight of the trainer's policy against
the rollout's, w = exp(d) per token or exp(sum_t d) per sequence (TRL's sequence level), multiplies the policy
loss of the token (TIS); above --rollout_is_threshold C it is cut to C (truncate) or set to 0 (mask).
--rollout_rs B > 0 rejects a sequence whose geometric-mean ratio exp(mean_t d) lies outside [1/B, B] (verl's
"geometric" RS): its weights become 0. Masked and rejected tokens stay in the loss's normaliser (as TRL's masks
do), so the normaliser does not depend on the trainer's forward. Weights are detached: they scale the gradient.
"""
import math
from dataclasses import dataclass

import torch

from livemoe.train.config import OptionError

IS_LEVELS = ("token", "sequence", "none")
IS_MODES = ("truncate", "mask")
LOG_WEIGHT_CLAMP = 20.0  # exp() of a sequence's summed log ratio stays finite in fp32


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutCorrectionConfig:
    # verl's TIS recommendation (token level, truncated at 2.0); TRL's default is sequence / mask / 3.0
    level: str = "token"
    threshold: float = 2.0
    mode: str = "truncate"
    rs_bound: float = 0.0  # 0 = no rejection sampling

    def __post_init__(self):
        if self.level not in IS_LEVELS:
            raise OptionError("level", f"must be one of {', '.join(IS_LEVELS)}; got {self.level!r}")
        if self.mode not in IS_MODES:
            raise OptionError("mode", f"must be one of {', '.join(IS_MODES)}; got {self.mode!r}")
        if not (isinstance(self.threshold, (int, float)) and math.isfinite(self.threshold) and self.threshold > 1):
            raise OptionError("threshold", f"must be a finite number > 1, got {self.threshold!r}")
        if not (isinstance(self.rs_bound, (int, float)) and math.isfinite(self.rs_bound)
                and (self.rs_bound == 0 or self.rs_bound > 1)):
            raise OptionError("rs_bound", f"must be 0 (off) or a finite number > 1, got {self.rs_bound!r}")

    @property
    def enabled(self) -> bool:
        return self.level != "none" or self.rs_bound > 0


def logprob_mismatch(trainer_lp, rollout_lp, mask) -> dict:
    """Sums over the completion tokens (mask [B, T]) of one micro-batch, 0-d tensors that add up over micro-batches
    and ranks (abs_diff_max: a max): see the module doc. trainer_lp and rollout_lp [B, T]."""
    mask = mask.float()
    d = (trainer_lp.detach().float() - rollout_lp.float()) * mask
    tokens = mask.sum(-1)
    has = (tokens > 0).float()
    k3 = (torch.exp(d.clamp(max=LOG_WEIGHT_CLAMP)) - d - 1) * mask
    log_ppl_ratio = -d.sum(-1) / tokens.clamp(min=1.0)
    return {"abs_diff_sum": d.abs().sum(), "abs_diff_max": d.abs().max(), "k3_sum": k3.sum(), "tokens": mask.sum(),
            "ppl_ratio_sum": (torch.exp(log_ppl_ratio.clamp(max=LOG_WEIGHT_CLAMP)) * has).sum(), "sequences": has.sum()}


def routing_disagreement(trainer_ids, rollout_ids, token_mask) -> tuple:
    """trainer_ids, rollout_ids [N, L, k] (each token's expert ids per MoE layer), token_mask [N]: (tokens whose
    expert set differs in some layer, per layer the tokens that differ there [L], tokens), masked sums."""
    differ = (trainer_ids.long().sort(-1).values != rollout_ids.long().sort(-1).values).any(-1)  # [N, L]
    w = token_mask.float()
    return (differ.any(-1).float() * w).sum(), (differ.float() * w[:, None]).sum(0), w.sum()


def rollout_correction(trainer_lp, rollout_lp, mask, cfg: RolloutCorrectionConfig) -> tuple:
    """(weights [B, T] detached, metric sums): the module doc's TIS / RS weights of one micro-batch. Sums:
    is_weight_sum / is_weight_max over the raw weights (before truncation), is_cut (tokens truncated or masked),
    rs_rejected (sequences), rs_sequences."""
    mask = mask.float()
    d = (trainer_lp.detach().float() - rollout_lp.float()) * mask
    if cfg.level == "token":
        log_w = d
    elif cfg.level == "sequence":
        log_w = d.sum(-1, keepdim=True).expand_as(d)
    else:
        log_w = torch.zeros_like(d)
    raw = torch.exp(log_w.clamp(-LOG_WEIGHT_CLAMP, LOG_WEIGHT_CLAMP))
    cut = (raw > cfg.threshold) & (mask > 0) if cfg.level != "none" else torch.zeros_like(mask, dtype=torch.bool)
    weights = raw.clamp(max=cfg.threshold) if cfg.mode == "truncate" else torch.where(cut, 0.0, raw)
    if cfg.level == "none":
        weights = torch.ones_like(raw)
    tokens = mask.sum(-1)
    has = tokens > 0
    rejected = torch.zeros_like(has)
    if cfg.rs_bound > 0:
        geo = d.sum(-1) / tokens.clamp(min=1.0)
        rejected = has & (geo.abs() > math.log(cfg.rs_bound))
        weights = weights * (~rejected).float()[:, None]
    sums = {"is_weight_sum": (raw * mask).sum(), "is_weight_max": (raw * mask).max(), "is_cut": cut.float().sum(),
            "rs_rejected": rejected.float().sum(), "rs_sequences": has.float().sum()}
    return weights * mask, sums


class MismatchMeter:
    """The step's mismatch and correction sums over its micro-batches (on the device, no host sync), reduced
    over the ranks once at the end (`metrics`)."""

    MAXIMA = ("abs_diff_max", "is_weight_max")

    def __init__(self, zero):
        self.zero = zero
        self.sums: dict = {}
        self.layers = None  # per-layer routing disagreement sums [L]

    def add_sums(self, sums: dict) -> None:
        for k, v in sums.items():
            old = self.sums.get(k)
            self.sums[k] = v.detach() if old is None else (torch.maximum(old, v) if k in self.MAXIMA else old + v)

    def add(self, trainer_lp, mb: dict, router_logits, top_k: int) -> None:
        """A micro-batch's log-prob mismatch and, when it holds the decoder's routed experts, routing disagreement."""
        self.add_sums(logprob_mismatch(trainer_lp, mb["rollout_logprobs"], mb["completion_mask"]))
        if "routed_experts" not in mb or not router_logits:
            return
        from livemoe.kernels.moe import select_experts

        B, T, L, k = mb["routed_experts"].shape
        mine = torch.stack([select_experts(x, top_k) for x in router_logits], dim=1)  # [B*T, L, k]
        theirs = mb["routed_experts"].to(mine.device).reshape(B * T, L, k)
        any_layer, per_layer, tokens = routing_disagreement(mine, theirs, mb["routed_mask"].reshape(-1))
        self.add_sums({"route_differ": any_layer, "route_tokens": tokens})
        self.layers = per_layer if self.layers is None else self.layers + per_layer

    def metrics(self, comm) -> dict:
        """The step's metrics over all ranks (`comm`: livemoe.train.distributed's; every rank calls this)."""
        # a rank with only empty micro-batches has no routing sums: every rank reduces the union, zeros for its gaps
        shapes = comm.all_gather_objects((sorted(self.sums), 0 if self.layers is None else len(self.layers)))
        keys = sorted({k for names, _ in shapes for k in names} - set(self.MAXIMA))
        num_layers = max(n for _, n in shapes)
        zero = self.zero()
        layers = self.layers if self.layers is not None else zero.new_zeros(num_layers)
        flat = torch.cat([torch.stack([self.sums.get(k, zero).float() for k in keys] + [zero])[:-1], layers.float()])
        flat = comm.sum(flat).tolist()
        t = dict(zip(keys, flat))
        per_layer = flat[len(keys):]
        mx = {k: max(comm.all_gather_objects(float(self.sums.get(k, 0.0)))) for k in self.MAXIMA
              if any(k in names for names, _ in shapes)}
        out = {}
        if "tokens" in t:
            n = max(t["tokens"], 1.0)
            out.update({"logprob_diff/mean": t["abs_diff_sum"] / n, "logprob_diff/max": mx["abs_diff_max"],
                        "mismatch/k3_kl": t["k3_sum"] / n,
                        "mismatch/ppl_ratio": t["ppl_ratio_sum"] / max(t["sequences"], 1.0)})
        if t.get("route_tokens"):
            out["mismatch/routing_disagreement"] = t["route_differ"] / t["route_tokens"]
            out.update({f"mismatch/routing_disagreement/layer_{i}": v / t["route_tokens"]
                        for i, v in enumerate(per_layer)})
        if "is_weight_sum" in t:
            n = max(t["tokens"], 1.0)
            out.update({"rollout_is/weight_mean": t["is_weight_sum"] / n, "rollout_is/weight_max": mx["is_weight_max"],
                        "rollout_is/over_threshold_frac": t["is_cut"] / n,
                        "rollout_rs/rejected_frac": t["rs_rejected"] / max(t["rs_sequences"], 1.0)})
        return out
