"""Top-k routing with Qwen3-MoE semantics: fp32 softmax over experts, top-k, optional renormalisation.

Differentiable in router_logits (through the kept weights), so the router trains. The CPU inference op
torch.ops.livemoe.moe_forward (csrc/moe_experts.cpp) does the same routing in C++ (where two experts' logits
are exactly equal it keeps the lower index; torch.topk's pick among ties is unspecified).
"""
import torch


def check_top_k(top_k: int, num_experts: int) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64)."""
    assert router_logits.dim() == 2, f"router_logits must be [T, E], got {tuple(router_logits.shape)}"
    check_top_k(top_k, router_logits.shape[1])
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids
