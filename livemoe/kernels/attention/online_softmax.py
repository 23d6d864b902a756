"""The step the paged attention kernels (decode.py, prefill.py, batch_invariant/attention.py) take per KV block, and
the query tile of the kernels that pack a KV head's query heads as rows."""
import triton
import triton.language as tl


@triton.jit
def attend_block(q, m_i, l_i, acc, K_cache, V_cache, block_id, kvh, offs_s, offs_d, d_mask,
                 stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, visible, scale,
                 IEEE: tl.constexpr):
    """Loads KV block `block_id` of head kvh, scores q [R, D] against it (-inf where `visible` is false)
    and folds it into the online softmax: running row max m_i, row sum l_i and output acc [R, D]."""
    k = tl.load(K_cache + block_id * stride_kb + offs_s[:, None] * stride_ks + kvh * stride_kh + offs_d[None, :],
                mask=d_mask[None, :], other=0.0)
    v = tl.load(V_cache + block_id * stride_vb + offs_s[:, None] * stride_vs + kvh * stride_vh + offs_d[None, :],
                mask=d_mask[None, :], other=0.0)
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(visible, s * scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if IEEE:
        pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit
def load_query_group(Q, row_offset, kvh, stride_qh, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                     BLOCK_G: tl.constexpr, BLOCK_D: tl.constexpr):
    """The GROUP query heads of KV head kvh of one token (at Q + row_offset) as the rows of a [BLOCK_G, BLOCK_D]
    tile (zeros past GROUP and HEAD_DIM) -> (q, heads, g_mask, offs_d, d_mask)."""
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    heads = kvh * GROUP + offs_g
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(Q + row_offset + heads[:, None] * stride_qh + offs_d[None, :], mask=g_mask[:, None] & d_mask[None, :],
                other=0.0)
    return q, heads, g_mask, offs_d, d_mask
