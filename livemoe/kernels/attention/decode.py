"""Triton: paged decode attention (one query token per sequence), split-KV, GQA heads packed.

One program handles (sequence, KV head, split): the GROUP query heads that share the KV head are the
rows of one tile, so each K/V block is loaded once for the whole group (decode is memory-bound; the
padding of the group to 16 rows for tl.dot costs no bandwidth). Long contexts are cut into NUM_SPLITS
ranges of blocks run in parallel; a second kernel merges them by their log-sum-exp.
NUM_SPLITS is fixed by the caller (not by the data), so the launch can be captured in a CUDA graph.
"""
import torch
import triton
import triton.language as tl

from livemoe.kernels.attention.online_softmax import attend_block, load_query_group


@triton.jit
def _paged_decode_kernel(Q, K_cache, V_cache, Block_tables, Context_lens, Out, Part_out, Part_lse, scale,
                         stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                         stride_bt, stride_ob, stride_oh, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                         GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                         BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
                         IEEE: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(Context_lens + b)
    num_blocks = tl.cdiv(ctx, BLOCK_SIZE)
    per_split = tl.cdiv(num_blocks, NUM_SPLITS)
    start = split * per_split
    end = tl.minimum(start + per_split, num_blocks)

    q, heads, g_mask, offs_d, d_mask = load_query_group(Q, b * stride_qb, kvh, stride_qh, GROUP, HEAD_DIM, BLOCK_G,
                                                        BLOCK_D)
    offs_s = tl.arange(0, BLOCK_SIZE)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for j in range(start, end):
        block_id = tl.load(Block_tables + b * stride_bt + j).to(tl.int64)
        pos = j * BLOCK_SIZE + offs_s
        m_i, l_i, acc = attend_block(q, m_i, l_i, acc, K_cache, V_cache, block_id, kvh, offs_s, offs_d, d_mask,
                                     stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                     pos[None, :] < ctx, scale, IEEE)

    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # an empty range (split or padded row) gives 0
    mask = g_mask[:, None] & d_mask[None, :]
    if NUM_SPLITS == 1:
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(Out.dtype.element_ty), mask=mask)
    else:
        l_safe = tl.where(l_i == 0.0, 1.0, l_i)
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log(l_safe))
        tl.store(Part_out + b * stride_pb + heads[:, None] * stride_ph + split * stride_ps + offs_d[None, :],
                 out, mask=mask)
        tl.store(Part_lse + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


@triton.jit
def _merge_splits_kernel(Part_out, Part_lse, Out, stride_pb, stride_ph, stride_ps, stride_lb, stride_lh,
                         stride_ob, stride_oh,
                         HEAD_DIM: tl.constexpr, NUM_SPLITS: tl.constexpr, BLOCK_S: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < NUM_SPLITS
    base = b * stride_pb + h * stride_ph
    lse = tl.load(Part_lse + b * stride_lb + h * stride_lh + offs_s, mask=s_mask, other=float("-inf"))
    lse_max = tl.max(lse, 0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    w = tl.exp(lse - lse_max)
    parts = tl.load(Part_out + base + offs_s[:, None] * stride_ps + offs_d[None, :],
                    mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    denom = tl.sum(w, 0)
    out = tl.sum(parts * w[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(Out + b * stride_ob + h * stride_oh + offs_d, out.to(Out.dtype.element_ty), mask=offs_d < HEAD_DIM)


def decode_meta(group: int, head_dim: int, block_size: int, num_splits: int, dtype: torch.dtype) -> dict:
    """The decode kernel's constexprs (also what bench/kernel_launches.py compiles)."""
    return dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size, BLOCK_G=max(16, triton.next_power_of_2(group)),
                BLOCK_D=max(16, triton.next_power_of_2(head_dim)), NUM_SPLITS=num_splits, IEEE=dtype == torch.float32)


def merge_meta(head_dim: int, num_splits: int) -> dict:
    return dict(HEAD_DIM=head_dim, NUM_SPLITS=num_splits, BLOCK_S=triton.next_power_of_2(num_splits),
                BLOCK_D=triton.next_power_of_2(head_dim))


def paged_decode_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                        context_lens: torch.Tensor, scale: float, num_splits: int = 1,
                        out: torch.Tensor | None = None) -> torch.Tensor:
    """q [B, Hq, D], caches [num_blocks, block_size, Hkv, D], block_tables [B, max_blocks] (int32),
    context_lens [B] (0 for a padded row: its output is 0) -> [B, Hq, D]."""
    B, hq, d = q.shape
    _, block_size, hkv, d_cache = k_cache.shape
    assert d_cache == d and hq % hkv == 0 and q.stride(-1) == 1, (q.shape, k_cache.shape)
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "Triton paged attention needs block_size >= 16"
    assert k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    group = hq // hkv
    out = torch.empty_like(q) if out is None else out
    if B == 0:
        return out
    meta = decode_meta(group, d, block_size, num_splits, q.dtype)
    if num_splits == 1:
        part_out = part_lse = out  # unused
        strides = (0, 0, 0, 0, 0)
    else:
        part_out = torch.empty(B, hq, num_splits, d, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(B, hq, num_splits, dtype=torch.float32, device=q.device)
        strides = (part_out.stride(0), part_out.stride(1), part_out.stride(2), part_lse.stride(0), part_lse.stride(1))
    _paged_decode_kernel[(B, hkv, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part_out, part_lse, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1), *strides, **meta)
    if num_splits > 1:
        _merge_splits_kernel[(B, hq)](part_out, part_lse, out, *strides, out.stride(0), out.stride(1),
                                      **merge_meta(d, num_splits))
    return out
