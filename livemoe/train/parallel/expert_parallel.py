"""The expert-parallel MoE layer: each rank of an EP group holds E / N whole experts (a contiguous range,
rank r holds experts [r * E/N, (r + 1) * E/N)), routing runs on every rank for its own tokens.

  route -> sort the (token, slot) pairs by expert -> exchange per-expert counts -> all-to-all the token rows
  to the ranks that own their experts -> fused_experts on the local experts -> all-to-all the outputs back
  -> weight by the routing weights and sum over the k slots (on the token's own rank, so the router's
  gradient never leaves it).

Everything is differentiable in the four tensors of fused_moe (tokens, router logits, both expert weights);
a rank whose experts receive no tokens still joins both all-to-alls and gets zero expert gradients.
"""
from dataclasses import dataclass

import torch
import torch.distributed as dist

from livemoe.kernels.moe import fused_experts, route
from livemoe.train.parallel.all_to_all import all_to_all


@dataclass(frozen=True)
class ExpertParallel:
    """This rank's share of the experts: what SparseMoeBlock needs to run its experts in parallel."""
    group: dist.ProcessGroup
    size: int          # ranks in the EP group
    rank: int          # this rank's index in it
    num_experts: int   # of the whole layer

    def __post_init__(self):
        if self.num_experts % self.size:
            raise ValueError(f"expert_parallel={self.size} does not divide num_experts={self.num_experts}")
        assert 0 <= self.rank < self.size, (self.rank, self.size)

    @property
    def num_local_experts(self) -> int:
        return self.num_experts // self.size

    @property
    def local_experts(self) -> slice:
        return slice(self.rank * self.num_local_experts, (self.rank + 1) * self.num_local_experts)

    def fused_moe(self, hidden_states, w_gate_up, w_down, router_logits, top_k: int, renormalize: bool,
                  topk_ids: torch.Tensor | None = None):
        """livemoe.kernels.moe.fused_moe's signature over this rank's experts (what SparseMoeBlock calls)."""
        return ep_fused_moe(hidden_states, w_gate_up, w_down, router_logits, top_k, renormalize, self,
                            topk_ids=topk_ids)


def _keep_in_graph(rows: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
    """rows [0, H] joined to the graph of `tensors` with zero gradient: a rank with no tokens for its
    experts still runs the backward all-to-all (its peers wait on it) and gives its experts zero grads."""
    zero = sum(t.sum() for t in tensors) * 0
    return rows * 0 + zero


def ep_fused_moe(hidden_states, w_gate_up, w_down, router_logits, top_k: int, renormalize: bool,
                 ep: ExpertParallel, *, topk_ids: torch.Tensor | None = None,
                 backend: str | None = None) -> torch.Tensor:
    """fused_moe with the experts spread over an EP group. hidden_states [T, H] and router_logits [T, E] are
    this rank's tokens; w_gate_up [E/N, 2I, H] and w_down [E/N, H, I] its local experts; topk_ids [T, k]:
    replayed experts (routing replay: the exchange follows them). Returns [T, H]."""
    num_tokens, hidden = hidden_states.shape
    n, e_local = ep.size, ep.num_local_experts
    if router_logits.shape != (num_tokens, ep.num_experts):
        raise ValueError(f"router_logits must be [T={num_tokens}, E={ep.num_experts}], "
                         f"got {tuple(router_logits.shape)}")
    if w_gate_up.shape[0] != e_local or w_down.shape[0] != e_local:
        raise ValueError(f"this EP rank holds {e_local} experts, got w_gate_up {tuple(w_gate_up.shape)} and "
                         f"w_down {tuple(w_down.shape)}")
    topk_weights, topk_ids = route(router_logits, top_k, renormalize, topk_ids)
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # pairs grouped by expert, so by owning rank
    tokens_per_expert = torch.bincount(flat_ids, minlength=ep.num_experts)
    recv_per_expert = torch.empty_like(tokens_per_expert)  # [source rank, local expert], flattened
    dist.all_to_all_single(recv_per_expert, tokens_per_expert, group=ep.group)
    send_splits = tokens_per_expert.view(n, e_local).sum(1).tolist()
    recv_splits = recv_per_expert.view(n, e_local).sum(1).tolist()

    x_recv = all_to_all(hidden_states[order // top_k], send_splits, recv_splits, ep.group)
    if x_recv.shape[0]:
        local_ids = torch.arange(e_local, device=x_recv.device).repeat(n).repeat_interleave(recv_per_expert)
        ones = torch.ones(x_recv.shape[0], 1, device=x_recv.device, dtype=torch.float32)
        y_recv = fused_experts(x_recv, w_gate_up, w_down, ones, local_ids[:, None], backend=backend)
    else:
        y_recv = _keep_in_graph(x_recv, w_gate_up, w_down)
    y_sorted = all_to_all(y_recv, recv_splits, send_splits, ep.group)

    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    y_pairs = y_sorted[inverse].view(num_tokens, top_k, hidden)
    return (y_pairs * topk_weights.to(y_pairs.dtype)[..., None]).sum(dim=1)
