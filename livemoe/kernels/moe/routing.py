"""Top-k routing with Qwen3-MoE semantics: fp32 softmax over experts, top-k, optional renormalisation.

Differentiable in router_logits (through the kept weights), so the router trains. The CPU inference op
torch.ops.livemoe.moe_forward (csrc/moe_experts.cpp) does the same routing in C++ (where two experts' logits
are exactly equal it keeps the lower index; torch.topk's pick among ties is unspecified).

Routing replay (R3, `topk_ids` given): the experts are the ones given (a rollout engine's choice) and only the
weights come from these router logits, softmax over all experts gathered at the given ids, renormalised as
the model's norm_topk_prob says; so the router still gets gradients through them.
"""
import torch

from livemoe.kernels import batch_invariant
from livemoe.kernels.batch_invariant import ops as exact_ops


def check_top_k(top_k: int, num_experts: int) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")


def select_experts(router_logits: torch.Tensor, top_k: int) -> torch.Tensor:
    """router_logits [T, E] -> topk_ids [T, k] int64: the experts route() picks (no weights, no gradient)."""
    check_top_k(top_k, router_logits.shape[-1])
    if batch_invariant.enabled():  # the experts the exact mode runs (ties: the lower id), whatever the batch
        return exact_ops.route(router_logits, top_k, False)[1]
    return torch.topk(torch.softmax(router_logits.detach(), dim=-1, dtype=torch.float32), top_k, dim=-1).indices


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          topk_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64). topk_ids [T, k] given: replay
    those experts (see the module doc)."""
    assert router_logits.dim() == 2, f"router_logits must be [T, E], got {tuple(router_logits.shape)}"
    check_top_k(top_k, router_logits.shape[1])
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    if topk_ids is None:
        topk_weights, topk_ids = torch.topk(probs, top_k, dim=-1)
    else:
        # the range check reads the ids on the host: on a GPU the model checks a forward's ids once (_replay_ids)
        check_replay(topk_ids, router_logits.shape[0], top_k, router_logits.shape[1],
                     check_range=topk_ids.device.type == "cpu")
        topk_ids = topk_ids.to(device=probs.device, dtype=torch.long)
        topk_weights = probs.gather(1, topk_ids)
    if renormalize:
        topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    return topk_weights, topk_ids


def check_replay(topk_ids: torch.Tensor, num_tokens: int | None, top_k: int, num_experts: int,
                 check_range: bool = True) -> None:
    """ValueError naming the problem for replayed expert ids that do not fit this layer (num_tokens None: any)."""
    if topk_ids.shape[-1] != top_k or (num_tokens is not None and tuple(topk_ids.shape) != (num_tokens, top_k)):
        raise ValueError(f"replayed topk_ids must be [T={num_tokens}, k={top_k}], got {tuple(topk_ids.shape)}")
    if check_range and topk_ids.numel() and not (0 <= int(topk_ids.min()) and int(topk_ids.max()) < num_experts):
        raise ValueError(f"replayed topk_ids must be expert ids in [0, {num_experts}), got the range "
                         f"[{int(topk_ids.min())}, {int(topk_ids.max())}]")
