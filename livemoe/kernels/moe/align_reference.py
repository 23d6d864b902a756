"""Routing align, its contract and its plain-PyTorch reference: group the T*k (token, slot) pairs by expert, padded per expert to the GEMM block size.

Contract (shared by the reference here, the C++ op csrc/moe_align.cpp and the Triton op align_triton.py,
which import this module, as the dispatcher align.py does):
  topk_ids [T, k] -> sorted_token_ids int32 [num_blocks * block_size]
                     expert_ids       int32 [num_blocks]
                     tokens_per_expert int32 [E]
                     num_tokens_post_padded int32 [1]
with num_blocks = ceil((T*k + min(E, T*k)*(block_size-1)) / block_size), a bound known without looking
at the data (static shapes: no host sync, CUDA-graph safe; at most min(E, T*k) experts are non-empty,
and an empty expert owns no block, which keeps decode grids small). sorted_token_ids holds flat indices token*k+slot;
padding slots hold the sentinel T*k (padding lives in indices only). expert_ids is -1 for blocks past
num_tokens_post_padded. Within an expert, pairs are in ascending flat index (deterministic).
"""
import torch


def num_align_blocks(num_pairs: int, num_experts: int, block_size: int) -> int:
    return -(-(num_pairs + min(num_experts, num_pairs) * (block_size - 1)) // block_size)


def moe_align_reference(topk_ids: torch.Tensor, num_experts: int, block_size: int):
    flat = topk_ids.reshape(-1).long()
    n = flat.numel()
    num_blocks = num_align_blocks(n, num_experts, block_size)
    device = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    padded_end = torch.cumsum(padded, 0)
    padded_start = padded_end - padded
    order = torch.argsort(flat, stable=True)  # by expert, ascending flat index within an expert
    sorted_experts = flat[order]
    rank = torch.arange(n, device=device) - (torch.cumsum(counts, 0) - counts)[sorted_experts]
    sorted_token_ids = torch.full((num_blocks * block_size,), n, dtype=torch.int32, device=device)
    sorted_token_ids[padded_start[sorted_experts] + rank] = order.to(torch.int32)
    block_start = torch.arange(num_blocks, device=device) * block_size
    expert_ids = torch.searchsorted(padded_end, block_start, right=True)
    expert_ids = torch.where(block_start < padded_end[-1], expert_ids, -1).to(torch.int32)
    return sorted_token_ids, expert_ids, counts.to(torch.int32), padded_end[-1:].to(torch.int32)
