"""Triton: causal attention of a step's new tokens (prefill chunks, or mixed prefill + decode) over
each sequence's paged cache, which already holds the cached prefix and the step's own K/V.

One program handles (sequence, query head, tile of BLOCK_M new tokens) and walks the sequence's KV
blocks up to the last position its tile can see: a prefix that came from the prefix cache costs no
recompute, only reading. Query i of a sequence with q_len new tokens sits at position
context_len - q_len + i.
"""
import torch
import triton
import triton.language as tl

from livemoe.kernels.attention.online_softmax import attend_block


@triton.jit
def _paged_prefill_kernel(Q, K_cache, V_cache, Cu_seqlens_q, Context_lens, Block_tables, Out, scale,
                          stride_qn, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                          stride_bt, stride_on, stride_oh,
                          GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr):
    s = tl.program_id(0)
    h = tl.program_id(1)
    mb = tl.program_id(2)
    q_start = tl.load(Cu_seqlens_q + s)
    q_len = tl.load(Cu_seqlens_q + s + 1) - q_start
    if mb * BLOCK_M >= q_len:
        return
    ctx = tl.load(Context_lens + s)
    first_pos = ctx - q_len
    kvh = h // GROUP

    offs_m = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_s = tl.arange(0, BLOCK_SIZE)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + (q_start + offs_m)[:, None] * stride_qn + h * stride_qh + offs_d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    q_pos = first_pos + offs_m

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    # the tile's last query sees positions up to first_pos + min((mb+1)*BLOCK_M, q_len) - 1
    num_blocks = tl.cdiv(first_pos + tl.minimum((mb + 1) * BLOCK_M, q_len), BLOCK_SIZE)
    for j in range(0, num_blocks):
        block_id = tl.load(Block_tables + s * stride_bt + j).to(tl.int64)
        kv_pos = j * BLOCK_SIZE + offs_s
        # position 0 is visible to every row, so each row's max is finite after the first block
        m_i, l_i, acc = attend_block(q, m_i, l_i, acc, K_cache, V_cache, block_id, kvh, offs_s, offs_d, d_mask,
                                     stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                                     kv_pos[None, :] <= q_pos[:, None], scale, IEEE)
    out = acc / l_i[:, None]
    tl.store(Out + (q_start + offs_m)[:, None] * stride_on + h * stride_oh + offs_d[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


def prefill_meta(group: int, head_dim: int, block_size: int, max_seqlen_q: int, block_m: int,
                 dtype: torch.dtype) -> dict:
    """The prefill kernel's constexprs (also what bench/kernel_launches.py compiles)."""
    return dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_SIZE=block_size,
                BLOCK_M=max(16, min(block_m, triton.next_power_of_2(max(1, max_seqlen_q)))),
                BLOCK_D=max(16, triton.next_power_of_2(head_dim)), IEEE=dtype == torch.float32)


def paged_prefill_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, cu_seqlens_q: torch.Tensor,
                         context_lens: torch.Tensor, block_tables: torch.Tensor, scale: float, max_seqlen_q: int,
                         block_m: int = 64) -> torch.Tensor:
    """q [N, Hq, D] -> [N, Hq, D]; see paged_attention_reference for the meaning of the arguments."""
    N, hq, d = q.shape
    _, block_size, hkv, _ = k_cache.shape
    assert hq % hkv == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_size >= 16 and block_size & (block_size - 1) == 0, "Triton paged attention needs block_size >= 16"
    out = torch.empty_like(q)
    S = context_lens.shape[0]
    if N == 0 or S == 0:
        return out
    meta = prefill_meta(hq // hkv, d, block_size, max_seqlen_q, block_m, q.dtype)
    grid = (S, hq, triton.cdiv(max_seqlen_q, meta["BLOCK_M"]))
    _paged_prefill_kernel[grid](
        q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, out, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), block_tables.stride(0),
        out.stride(0), out.stride(1),
        **meta)
    return out
