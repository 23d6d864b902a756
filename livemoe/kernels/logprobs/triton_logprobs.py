"""Triton log-probs: online logsumexp over vocabulary tiles (forward) and d logits recomputed tile by tile
(backward). Same math as chunked.py, whose docstring derives it.

Forward: grid (token blocks, vocabulary splits). Each program walks its split's vocabulary tiles,
computing the [BLOCK_N, BLOCK_V] logits with tl.dot over H in fp32, keeping a running max / sum /
entropy term and picking out the target's logit; the splits' partials are merged in torch
([splits, N] floats). The splits fill the GPU when N is small; the grid has no size limit in tokens
(axis 0 takes 2**31 - 1 blocks).

Backward: per chunk of the vocabulary (and of tokens, only when N is huge), a kernel on a 2-D grid
(token blocks, vocabulary tiles) recomputes the logits of its tiles and writes d logits into a
[tokens, chunk] buffer (the only big buffer, bounded by the chunk); cuBLAS then gives that chunk's
rows of d W = dz^T @ hidden in one GEMM and adds dz @ W[chunk] to d hidden ([N, H], kept in fp32).

`n_valid` (a device scalar, optional) marks rows >= n_valid as inactive: their programs skip the
matmul, their outputs and gradients are 0. This is how masked rows are dropped without a host sync.
"""
import torch
import triton
import triton.language as tl

from livemoe.kernels._ext import sm_count
from livemoe.kernels.dot_precision import dot_precision

NEG_INIT = tl.constexpr(-1e30)  # a constexpr object: jit code may read only those globals


@triton.jit
def _logprobs_fwd_kernel(h_ptr, w_ptr, tgt_ptr, n_valid_ptr, m_ptr, l_ptr, e_ptr, t_ptr,
                         N, V, H, stride_h, stride_w, inv_temp, vocab_per_split,
                         HAS_N_VALID: tl.constexpr, WITH_ENTROPY: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_s = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    rows64 = rows.to(tl.int64)
    v_lo = pid_s * vocab_per_split
    v_hi = tl.minimum(v_lo + vocab_per_split, V)
    if HAS_N_VALID:  # an inactive block runs no vocabulary tile
        n_valid = tl.load(n_valid_ptr).to(tl.int32)
        v_hi = tl.where(pid_n * BLOCK_N < n_valid, v_hi, v_lo)
    tgt = tl.load(tgt_ptr + rows, mask=row_ok, other=-1)
    m = tl.full([BLOCK_N], NEG_INIT, tl.float32)
    l = tl.zeros([BLOCK_N], tl.float32)
    e = tl.zeros([BLOCK_N], tl.float32)
    t = tl.zeros([BLOCK_N], tl.float32)
    for v0 in range(v_lo, v_hi, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        col_ok = cols < v_hi
        cols64 = cols.to(tl.int64)
        acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ks = k0 + tl.arange(0, BLOCK_K)
            k_ok = ks < H
            a = tl.load(h_ptr + rows64[:, None] * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(w_ptr + cols64[None, :] * stride_w + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
            acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
        s = tl.where(col_ok[None, :], acc * inv_temp, NEG_INIT)  # finite: p * (s - m) stays 0 there
        t += tl.sum(tl.where((cols[None, :] == tgt[:, None]) & col_ok[None, :], s, 0.0), 1)
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp(m - m_new)
        c = s - m_new[:, None]
        p = tl.exp(c)  # 0 on masked columns
        if WITH_ENTROPY:
            e = alpha * (e + (m - m_new) * l) + tl.sum(p * c, 1)
        l = l * alpha + tl.sum(p, 1)
        m = m_new
    out = pid_s * N + rows
    tl.store(m_ptr + out, m, mask=row_ok)
    tl.store(l_ptr + out, l, mask=row_ok)
    tl.store(t_ptr + out, t, mask=row_ok)
    if WITH_ENTROPY:
        tl.store(e_ptr + out, e, mask=row_ok)


@triton.jit
def _logprobs_bwd_dz_kernel(h_ptr, w_ptr, tgt_ptr, n_valid_ptr, lse_ptr, gl_ptr, a_ptr, b_ptr, dz_ptr,
                            row0, N, col0, V, H, stride_h, stride_w, stride_dz, inv_temp,
                            HAS_N_VALID: tl.constexpr, WITH_B: tl.constexpr, INPUT_PRECISION: tl.constexpr,
                            BLOCK_N: tl.constexpr, BLOCK_V: tl.constexpr, BLOCK_K: tl.constexpr):
    """d logits of rows [row0, row0 + N) and columns [col0, col0 + V) (this chunk) into dz [N, V]."""
    pid_n = tl.program_id(0)
    pid_v = tl.program_id(1)
    rows = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # within the chunk
    row_ok = rows < N
    live = row_ok
    k_hi = H
    if HAS_N_VALID:  # an inactive block skips the matmul and writes zeros
        n_valid = tl.load(n_valid_ptr).to(tl.int32) - row0
        live = live & (rows < n_valid)
        k_hi = tl.where(pid_n * BLOCK_N < n_valid, H, 0)
    grows64 = (row0 + rows).to(tl.int64)
    cols = pid_v * BLOCK_V + tl.arange(0, BLOCK_V)  # within the chunk
    col_ok = cols < V
    cols64 = (col0 + cols).to(tl.int64)
    acc = tl.zeros([BLOCK_N, BLOCK_V], tl.float32)
    for k0 in range(0, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < H
        a = tl.load(h_ptr + grows64[:, None] * stride_h + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(w_ptr + cols64[None, :] * stride_w + ks[:, None], mask=col_ok[None, :] & k_ok[:, None], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=INPUT_PRECISION)
    lse = tl.load(lse_ptr + row0 + rows, mask=live, other=0.0)
    coef_a = tl.load(a_ptr + row0 + rows, mask=live, other=0.0)
    g_lp = tl.load(gl_ptr + row0 + rows, mask=live, other=0.0)
    tgt = tl.load(tgt_ptr + row0 + rows, mask=live, other=-1)
    c = acc * inv_temp - lse[:, None]  # log p
    p = tl.exp(c)
    if WITH_B:
        coef_b = tl.load(b_ptr + row0 + rows, mask=live, other=0.0)
        dz = p * (coef_a[:, None] + coef_b[:, None] * c)
    else:
        dz = p * coef_a[:, None]
    dz += tl.where((col0 + cols)[None, :] == tgt[:, None], g_lp[:, None], 0.0)
    dz = tl.where(live[:, None], dz, 0.0)
    tl.store(dz_ptr + rows.to(tl.int64)[:, None] * stride_dz + cols[None, :], dz.to(dz_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])



def launch_meta(n: int, h: int, dtype: torch.dtype) -> dict:
    """Tiles and warps of both kernels (also what bench/kernel_launches.py compiles for sm_90a). The 64-row tile
    runs on 8 warps: on 4 its [64, 128] fp32 logits and their exp/entropy temporaries need 220-255 registers
    a thread (8 warps per SM); fp32 operands take half the K depth, which keeps them out of local memory."""
    block_n = 16 if n <= 16 else (32 if n <= 32 else 64)
    block_k = 32 if h <= 32 or dtype == torch.float32 else 64
    return dict(BLOCK_N=block_n, BLOCK_V=128, BLOCK_K=block_k, INPUT_PRECISION=dot_precision(dtype),
                num_warps=8 if block_n == 64 else 4)


def forward(hidden, weight, targets, n_valid, inv_temp: float, with_entropy: bool, vocab_splits: int | None = None):
    """-> (logprobs, lse, entropy or None), each [N] fp32; rows >= n_valid give 0."""
    n, h = hidden.shape
    v = weight.shape[0]
    meta = launch_meta(n, h, hidden.dtype)
    block_n, block_v = meta["BLOCK_N"], meta["BLOCK_V"]
    n_blocks = triton.cdiv(n, block_n)
    v_tiles = triton.cdiv(v, block_v)
    if vocab_splits is None:  # enough programs to fill the GPU when N is small
        sms = sm_count(hidden.device)
        vocab_splits = max(1, min(v_tiles, triton.cdiv(2 * sms, n_blocks)))
    vocab_per_split = triton.cdiv(v_tiles, vocab_splits) * block_v
    splits = triton.cdiv(v, vocab_per_split)  # every split holds >= 1 real column
    part = torch.empty((4, splits, n), dtype=torch.float32, device=hidden.device)
    m, l, e, t = part.unbind(0)
    _logprobs_fwd_kernel[(n_blocks, splits)](
        hidden, weight, targets, n_valid if n_valid is not None else targets, m, l, e, t,
        n, v, h, hidden.stride(0), weight.stride(0), inv_temp, vocab_per_split,
        HAS_N_VALID=n_valid is not None, WITH_ENTROPY=with_entropy, **meta)
    big_m = m.amax(0)
    scale = torch.exp(m - big_m)
    big_l = (l * scale).sum(0)
    log_l = torch.log(big_l)
    lse = big_m + log_l
    logprobs = t.sum(0) - lse
    entropy = None
    if with_entropy:
        big_e = (scale * (e + (m - big_m) * l)).sum(0)
        entropy = log_l - big_e / big_l
    if n_valid is not None:
        valid = torch.arange(n, device=hidden.device) < n_valid
        logprobs = torch.where(valid, logprobs, 0.0)
        lse = torch.where(valid, lse, 0.0)
        entropy = None if entropy is None else torch.where(valid, entropy, 0.0)
    return logprobs, lse, entropy


def backward(hidden, weight, targets, n_valid, inv_temp: float, lse, g_lp, a, b, chunk_tokens: int,
             chunk_vocab: int, need_dhidden: bool, need_dweight: bool, fp32_accumulation: bool):
    """d hidden and d weight, vocabulary chunk by vocabulary chunk (token chunks inside only when N is
    too large for the d logits buffer): each chunk's d weight rows come from one GEMM over its tokens,
    and d hidden ([N, H], small) sums over the chunks, in fp32 when fp32_accumulation."""
    n, h = hidden.shape
    v = weight.shape[0]
    meta = launch_meta(min(n, chunk_tokens), h, hidden.dtype)
    block_n, block_v = meta["BLOCK_N"], meta["BLOCK_V"]
    chunk_vocab = max(block_v, chunk_vocab // block_v * block_v)
    dtype = hidden.dtype
    acc_dtype = torch.float32 if fp32_accumulation else dtype
    dh_acc = torch.zeros((n, h), dtype=acc_dtype, device=hidden.device) if need_dhidden else None
    dweight = torch.empty_like(weight) if need_dweight else None
    token_chunks = [(n0, min(n, n0 + chunk_tokens)) for n0 in range(0, n, chunk_tokens)]
    dz = torch.empty((min(n, chunk_tokens), min(v, chunk_vocab)), dtype=dtype, device=hidden.device)
    for v0 in range(0, v, chunk_vocab):
        v1 = min(v, v0 + chunk_vocab)
        w = weight[v0:v1]
        dw_acc = None
        if need_dweight and len(token_chunks) > 1:
            dw_acc = torch.zeros((v1 - v0, h), dtype=acc_dtype, device=weight.device)
        for n0, n1 in token_chunks:
            dzc = dz[: n1 - n0, : v1 - v0]
            _logprobs_bwd_dz_kernel[(triton.cdiv(n1 - n0, block_n), triton.cdiv(v1 - v0, block_v))](
                hidden, weight, targets, n_valid if n_valid is not None else targets, lse, g_lp, a,
                b if b is not None else a, dzc, n0, n1 - n0, v0, v1 - v0, h, hidden.stride(0), weight.stride(0),
                dzc.stride(0), inv_temp, HAS_N_VALID=n_valid is not None, WITH_B=b is not None,
                **meta)
            if need_dhidden:
                _accumulate(dh_acc[n0:n1], dzc, w)
            if need_dweight:
                if dw_acc is None:
                    torch.mm(dzc.t(), hidden[n0:n1], out=dweight[v0:v1])
                else:
                    _accumulate(dw_acc, dzc.t(), hidden[n0:n1])
        if dw_acc is not None:
            dweight[v0:v1] = dw_acc
    dhidden = dh_acc.to(dtype) if need_dhidden else None
    return dhidden, dweight


def _accumulate(acc, x, y):
    """acc += x @ y: in place where the dtypes agree, else through an [x rows, y cols] product."""
    if acc.dtype == x.dtype:
        acc.addmm_(x, y)
    else:
        acc.add_(x @ y)
