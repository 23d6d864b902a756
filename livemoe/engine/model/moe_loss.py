"""MoE load-balancing loss (Switch Transformer), in the two forms trainers use.

mode "global" is transformers' `load_balancing_loss_func`: token fractions and mean router
probabilities pooled over all layers and (unmasked) tokens, E * sum_e f_e * P_e; it equals top_k at
perfect balance. mode "per_layer" is MegaBlocks': the same product computed per layer, scaled by
E / (tokens * top_k), averaged over layers; it equals 1 at perfect balance.
"""
import torch

MODES = ("global", "per_layer")


def load_balancing_loss(router_logits, num_experts: int, top_k: int, attention_mask=None, mode: str = "global",
                        group=None, selected=None):
    """router_logits: a sequence of [N, E] tensors (one per MoE layer, N = B*T); attention_mask [B, T];
    selected: per layer the experts the tokens ran on ([N, k]; default the router's top-k), as routing replay
    sets them.

    `group` (a process group of data-parallel ranks, each holding its share of the batch): the expert counts
    and token counts are summed over its ranks, so the loss counts every token of the global batch; each rank
    returns its share (its tokens' router probabilities against the global counts), and the shares sum to
    the loss of the whole batch in one process, as the summed gradients do."""
    if mode not in MODES:
        raise ValueError(f"load-balancing loss mode must be one of {MODES}, got {mode!r}")
    if not router_logits:
        raise ValueError("load_balancing_loss needs router logits from at least one MoE layer")
    weight = None if attention_mask is None else attention_mask.reshape(-1).float()
    counts, prob_sums, rows = [], [], []
    for i, logits in enumerate(router_logits):
        probs = torch.softmax(logits.float(), dim=-1)
        ids = torch.topk(probs, top_k, dim=-1).indices if selected is None else selected[i].to(probs.device)
        w = torch.ones(probs.shape[0], device=probs.device) if weight is None else weight.to(probs.device)
        counts.append(torch.zeros(num_experts, device=probs.device).scatter_add_(
            0, ids.reshape(-1), w.repeat_interleave(top_k)))
        prob_sums.append((probs * w[:, None]).sum(0))
        rows.append(w.sum())
    counts, prob_sums, rows = torch.stack(counts), torch.stack(prob_sums), torch.stack(rows)  # [L, E], [L, E], [L]
    if group is not None:
        import torch.distributed as dist

        totals = torch.cat([counts, rows[:, None]], dim=1)
        dist.all_reduce(totals, group=group)  # counts carry no gradient: only the probabilities train
        counts, rows = totals[:, :-1], totals[:, -1]
    if mode == "per_layer":
        return (num_experts / (rows * top_k) * (counts * prob_sums / rows[:, None]).sum(1)).mean()
    rows_sum = rows.sum()
    return num_experts * ((counts.sum(0) / rows_sum) * (prob_sums.sum(0) / rows_sum)).sum()
