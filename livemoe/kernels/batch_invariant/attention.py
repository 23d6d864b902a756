"""Triton: the exact mode's attention, one program per (query token, KV head), for decode, chunked prefill and the
trainer's causal batch alike.

Query n of sequence s (its queries at cu_seqlens_q[s]..[s+1], the last of its context_lens[s] tokens) sees the
positions 0..last. The program holds the GROUP query heads of its KV head as the rows of one tile (a row's
neighbours are the same token's other heads in every call) and walks the context in tiles of BLOCK_N positions
from position 0 upwards, whatever the cache's block size: each position's K/V is gathered from its slot
block_tables[s, pos // block_size] * block_size + pos % block_size, and folded into the online softmax
(attention/online_softmax.attend_block) tile by tile. So a query's scores, running max, sums and output are one
fixed sequence of operations that depends on its position alone: not on the batch, the step (decode or a
prefill chunk), the prefix cache or the page size. The trainer's batch is a cache of one block of T tokens per
sequence (`causal`).
"""
import torch
import triton
import triton.language as tl

from livemoe.kernels.attention.online_softmax import attend_block, load_query_group
from livemoe.kernels.batch_invariant.checks import same_dtype

BLOCK_N = 32  # positions per step of the KV walk: a constant, so every query's walk is cut alike


@triton.jit(do_not_specialize=["block_size"])
def bi_attention_kernel(Q, K_cache, V_cache, Seq_of, Cu_seqlens_q, Context_lens, Block_tables, Out, scale, block_size,
                        stride_qn, stride_qh, stride_ks, stride_kh, stride_vs, stride_vh, stride_bt, stride_on,
                        stride_oh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_G: tl.constexpr,
                        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, IEEE: tl.constexpr):
    n = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.load(Seq_of + n)
    q_start = tl.load(Cu_seqlens_q + s)
    q_len = tl.load(Cu_seqlens_q + s + 1) - q_start
    last = tl.load(Context_lens + s) - q_len + (n - q_start)  # this query's position: it sees 0..last

    q, heads, g_mask, offs_d, d_mask = load_query_group(Q, n.to(tl.int64) * stride_qn, kvh, stride_qh, GROUP,
                                                        HEAD_DIM, BLOCK_G, BLOCK_D)
    offs_n = tl.arange(0, BLOCK_N)
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    for t in range(0, tl.cdiv(last + 1, BLOCK_N)):
        pos = t * BLOCK_N + offs_n
        visible = pos <= last
        safe = tl.where(visible, pos, 0)  # a position past the query reads position 0's slot (finite), scored -inf
        block = tl.load(Block_tables + s.to(tl.int64) * stride_bt + safe // block_size).to(tl.int64)
        slots = block * block_size + safe % block_size
        # slot-strided addressing (block stride = block_size * slot stride: the caches are contiguous)
        m_i, l_i, acc = attend_block(q, m_i, l_i, acc, K_cache, V_cache, 0, kvh, slots, offs_d, d_mask,
                                     0, stride_ks, stride_kh, 0, stride_vs, stride_vh, visible[None, :], scale, IEEE)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]  # a query with no context (a padded decode row) gives 0
    tl.store(Out + n.to(tl.int64) * stride_on + heads[:, None] * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])


def attention_meta(group: int, head_dim: int, dtype: torch.dtype) -> dict:
    return dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_G=max(16, triton.next_power_of_2(group)),
                BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_N=BLOCK_N, IEEE=dtype == torch.float32)


def bi_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float) -> torch.Tensor:
    """q [N, Hq, D] over the paged caches [num_blocks, block_size, Hkv, D] -> [N, Hq, D] (see the module doc);
    every query belongs to a sequence (cu_seqlens_q[-1] == N)."""
    N, hq, d = q.shape
    _, block_size, hkv, d_cache = k_cache.shape
    assert d_cache == d and hq % hkv == 0 and v_cache.shape == k_cache.shape, (q.shape, k_cache.shape)
    assert k_cache.is_contiguous() and v_cache.is_contiguous(), "the caches' slots are addressed as contiguous"
    same_dtype("bi_attention", q=q, k_cache=k_cache, v_cache=v_cache)
    q = q.contiguous()
    out = torch.empty_like(q)
    if N == 0:
        return out
    ints = dict(dtype=torch.int32, device=q.device)
    seq_of = torch.repeat_interleave(torch.arange(context_lens.shape[0], **ints), cu_seqlens_q.diff(),
                                     output_size=N)  # no host sync: N is known
    block_tables = block_tables.contiguous()
    bi_attention_kernel[(N, hkv)](
        q, k_cache, v_cache, seq_of, cu_seqlens_q.to(torch.int32), context_lens.to(torch.int32), block_tables, out,
        scale, block_size, q.stride(0), q.stride(1), k_cache.stride(1), k_cache.stride(2), v_cache.stride(1),
        v_cache.stride(2), block_tables.stride(0), out.stride(0), out.stride(1), **attention_meta(hq // hkv, d, q.dtype))
    return out
