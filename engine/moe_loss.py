"""MoE load-balancing loss (Switch Transformer), in the two forms trainers use.

mode "global" is transformers' `load_balancing_loss_func`: token fractions and mean router
probabilities pooled over all layers and (unmasked) tokens, E * sum_e f_e * P_e; it equals top_k at
perfect balance. mode "per_layer" is MegaBlocks': the same product computed per layer, scaled by
E / (tokens * top_k), averaged over layers; it equals 1 at perfect balance.
"""
import torch

MODES = ("global", "per_layer")


def load_balancing_loss(router_logits, num_experts: int, top_k: int, attention_mask=None, mode: str = "global"):
    """router_logits: a sequence of [N, E] tensors (one per MoE layer, N = B*T); attention_mask [B, T]."""
    if mode not in MODES:
        raise ValueError(f"load-balancing loss mode must be one of {MODES}, got {mode!r}")
    if not router_logits:
        raise ValueError("load_balancing_loss needs router logits from at least one MoE layer")
    weight = None if attention_mask is None else attention_mask.reshape(-1).float()
    per_layer = []
    counts_sum = probs_sum = rows_sum = 0.0
    for logits in router_logits:
        probs = torch.softmax(logits.float(), dim=-1)
        selected = torch.topk(probs, top_k, dim=-1).indices
        w = torch.ones(probs.shape[0], device=probs.device) if weight is None else weight.to(probs.device)
        counts = torch.zeros(num_experts, device=probs.device).scatter_add_(
            0, selected.reshape(-1), w.repeat_interleave(top_k))
        prob_sum = (probs * w[:, None]).sum(0)
        rows = w.sum()
        if mode == "per_layer":
            per_layer.append(num_experts / (rows * top_k) * (counts * prob_sum / rows).sum())
        counts_sum, probs_sum, rows_sum = counts_sum + counts, probs_sum + prob_sum, rows_sum + rows
    if mode == "per_layer":
        return torch.stack(per_layer).mean()
    return num_experts * ((counts_sum / rows_sum) * (probs_sum / rows_sum)).sum()
