"""Routing align on the GPU in Triton: same contract and same output as `moe_align_reference` (align.py).

No host synchronisation and static shapes, so it can sit inside a CUDA graph. Deterministic without
atomics: the T*k pairs are cut into chunks; one launch counts each chunk's pairs per expert, one scans
those counts over the chunks per expert, then every chunk's program places its pairs (padded expert
start + the expert's pairs in earlier chunks + rank inside the chunk), so pairs keep ascending flat
order within an expert. When one chunk holds every pair (decode) a single launch does it all.
"""
import torch
import triton
import triton.language as tl

from livemoe.kernels.moe.align_reference import num_align_blocks


@triton.jit
def _chunk_onehot(ids_ptr, chunk, num_pairs, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    ids = tl.load(ids_ptr + offs, mask=offs < num_pairs, other=-1).to(tl.int32)
    return offs, (ids[:, None] == tl.arange(0, E_PAD)[None, :]).to(tl.int32)  # [CHUNK, E_PAD]


@triton.jit
def _align_count_kernel(ids_ptr, chunk_counts_ptr, num_pairs, CHUNK: tl.constexpr, E_PAD: tl.constexpr):
    pid = tl.program_id(0)
    _, onehot = _chunk_onehot(ids_ptr, pid, num_pairs, CHUNK, E_PAD)
    tl.store(chunk_counts_ptr + pid * E_PAD + tl.arange(0, E_PAD), tl.sum(onehot, axis=0))


@triton.jit
def _align_scan_kernel(chunk_counts_ptr, chunk_offsets_ptr, totals_ptr, num_chunks,
                       E_PAD: tl.constexpr, EXPERTS: tl.constexpr, ROWS: tl.constexpr):
    """Per expert, the exclusive prefix sum of the chunk counts over the chunks, and the total."""
    cols = tl.program_id(0) * EXPERTS + tl.arange(0, EXPERTS)
    carry = tl.zeros([EXPERTS], dtype=tl.int32)
    for r in range(0, num_chunks, ROWS):
        rows = r + tl.arange(0, ROWS)
        mask = rows[:, None] < num_chunks
        offs = rows[:, None] * E_PAD + cols[None, :]
        c = tl.load(chunk_counts_ptr + offs, mask=mask, other=0)
        tl.store(chunk_offsets_ptr + offs, tl.cumsum(c, axis=0) - c + carry[None, :], mask=mask)
        carry += tl.sum(c, axis=0)
    tl.store(totals_ptr + cols, carry)


@triton.jit
def _align_scatter_kernel(ids_ptr, chunk_offsets_ptr, chunk_totals_ptr, sorted_ids_ptr, expert_ids_ptr, counts_ptr,
                          total_ptr, num_pairs, num_experts, num_chunks, num_positions,
                          BLOCK_SIZE: tl.constexpr, CHUNK: tl.constexpr, E_PAD: tl.constexpr,
                          SINGLE: tl.constexpr, FILL: tl.constexpr):
    pid = tl.program_id(0)
    experts = tl.arange(0, E_PAD)
    offs, onehot = _chunk_onehot(ids_ptr, pid, num_pairs, CHUNK, E_PAD)
    if SINGLE:  # one chunk: count here, nothing comes before it
        totals = tl.sum(onehot, axis=0)
        before = tl.zeros([E_PAD], dtype=tl.int32)
    else:
        totals = tl.load(chunk_totals_ptr + experts)
        before = tl.load(chunk_offsets_ptr + pid * E_PAD + experts)
    padded = (totals + BLOCK_SIZE - 1) // BLOCK_SIZE * BLOCK_SIZE
    padded_end = tl.cumsum(padded, axis=0)
    padded_start = padded_end - padded

    # this chunk's pairs: expert start + earlier chunks' pairs of the expert + rank inside the chunk
    rank = tl.cumsum(onehot, axis=0) - onehot
    dest = tl.sum(onehot * (rank + (padded_start + before)[None, :]), axis=1)
    tl.store(sorted_ids_ptr + dest, offs.to(tl.int32), mask=offs < num_pairs)

    # padding slots (sentinel = num_pairs) and the expert of every block, split over the programs
    for start in range(pid * FILL, num_positions, num_chunks * FILL):
        pos = start + tl.arange(0, FILL)
        in_seg = (pos[:, None] >= padded_start[None, :]) & (pos[:, None] < padded_end[None, :])  # [FILL, E_PAD]
        real = tl.sum(tl.where(in_seg, (pos[:, None] - padded_start[None, :]) < totals[None, :], False).to(tl.int32),
                      axis=1)
        tl.store(sorted_ids_ptr + pos, tl.full([FILL], 0, tl.int32) + num_pairs, mask=(pos < num_positions) & (real == 0))
        expert = tl.sum(tl.where(in_seg, experts[None, :], 0), axis=1)
        owned = tl.sum(in_seg.to(tl.int32), axis=1) > 0
        is_block_start = (pos % BLOCK_SIZE == 0) & (pos < num_positions)
        tl.store(expert_ids_ptr + pos // BLOCK_SIZE, tl.where(owned, expert, -1), mask=is_block_start)
    if pid == 0:
        tl.store(counts_ptr + experts, totals, mask=experts < num_experts)
        tl.store(total_ptr + experts, tl.sum(padded, axis=0) + experts * 0, mask=experts == 0)


def align_meta(num_pairs: int, num_experts: int, chunk: int | None = None) -> dict:
    """The launch parameters of the align kernels (also what bench/kernel_launches.py compiles)."""
    e_pad = triton.next_power_of_2(num_experts)
    if chunk is None:  # the one-hot tile CHUNK x E_PAD (and its scan) stays within 64 KiB
        chunk = max(16, min(triton.next_power_of_2(max(num_pairs, 1)), 16384 // e_pad))
    return dict(E_PAD=e_pad, CHUNK=chunk, num_warps=8 if chunk * e_pad >= 8192 else 4,
                FILL=max(16, min(128, 8192 // e_pad)), EXPERTS=min(e_pad, 32), ROWS=64)


def moe_align_triton(topk_ids: torch.Tensor, num_experts: int, block_size: int, chunk: int | None = None):
    """topk_ids [T, k] -> (sorted_token_ids, expert_ids, tokens_per_expert, num_tokens_post_padded), as in align.py.

    Expert ids must lie in [0, num_experts); they are not checked here (a check would sync the host).
    """
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    n = ids.numel()
    meta = align_meta(n, num_experts, chunk)
    e_pad, chunk, warps, fill = meta["E_PAD"], meta["CHUNK"], meta["num_warps"], meta["FILL"]
    num_chunks = max(1, -(-n // chunk))
    num_blocks = num_align_blocks(n, num_experts, block_size)
    dev = ids.device
    sorted_ids = torch.empty(num_blocks * block_size, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(num_blocks, dtype=torch.int32, device=dev)
    counts = torch.empty(num_experts, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    single = num_chunks == 1
    chunk_counts = torch.empty(1 if single else num_chunks * e_pad, dtype=torch.int32, device=dev)
    chunk_offsets = torch.empty_like(chunk_counts)
    chunk_totals = torch.empty(1 if single else e_pad, dtype=torch.int32, device=dev)
    if not single:  # counts per chunk, then their prefix over the chunks per expert
        _align_count_kernel[(num_chunks,)](ids, chunk_counts, n, CHUNK=chunk, E_PAD=e_pad, num_warps=warps)
        experts_per_program = meta["EXPERTS"]
        _align_scan_kernel[(e_pad // experts_per_program,)](chunk_counts, chunk_offsets, chunk_totals, num_chunks,
                                                            E_PAD=e_pad, EXPERTS=experts_per_program, ROWS=meta["ROWS"])
    _align_scatter_kernel[(num_chunks,)](ids, chunk_offsets, chunk_totals, sorted_ids, expert_ids, counts, total, n,
                                         num_experts, num_chunks, num_blocks * block_size, BLOCK_SIZE=block_size,
                                         CHUNK=chunk, E_PAD=e_pad, SINGLE=single, FILL=fill, num_warps=warps)
    return sorted_ids, expert_ids, counts, total
