"""Triton: the exact mode's linear, x [M, K] @ w [N, K]^T (+ bias) -> [M, N] in x's dtype.

Batch-invariant by construction: the tile sizes come from the dtype alone (never from M), there is no split-K,
and each output tile walks K in BLOCK_K steps from 0 upwards with one tl.dot per step, so an output element is
the same fp32 sum in the same order whatever the number of rows in the launch or the row's place in its tile.
M is not specialised on (an M of 1 would otherwise compile another kernel).
"""
import torch
import triton
import triton.language as tl

from livemoe.kernels.batch_invariant.checks import same_dtype
from livemoe.kernels.dot_precision import dot_precision
from livemoe.kernels.moe.grouped_gemm import gathered_dot


@triton.jit(do_not_specialize=["M"])
def bi_linear_kernel(x_ptr, w_ptr, b_ptr, out_ptr, M, N, K, stride_xm, stride_wn, stride_om,
                     HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                     PRECISION: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    valid = rows < M
    n_ok = offs_n < N
    acc = gathered_dot(x_ptr, rows.to(tl.int64), valid, stride_xm, 1, w_ptr, offs_n, n_ok, stride_wn, 1, K,
                       BLOCK_M, BLOCK_N, BLOCK_K, PRECISION)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + rows.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_ok[None, :])


def linear_meta(dtype: torch.dtype) -> dict:
    """The tiles (and warps) of a dtype: the only things besides K that fix an output's summation order."""
    if dtype == torch.float32:  # fp32 tiles cost twice the registers of 16-bit ones (ieee dot: FMA loops)
        return dict(BLOCK_M=32, BLOCK_N=64, BLOCK_K=32, PRECISION=dot_precision(dtype), num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64, PRECISION=dot_precision(dtype), num_warps=4, num_stages=3)


def bi_linear(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] @ w [N, K]^T (+ bias [N]) in x's dtype, each output row computed as if it were alone."""
    assert x.dim() == 2 and w.dim() == 2 and x.shape[1] == w.shape[1], (x.shape, w.shape)
    same_dtype("bi_linear", x=x, w=w)
    x, w = x.contiguous(), w.contiguous()
    M, K = x.shape
    N = w.shape[0]
    out = torch.empty(M, N, dtype=x.dtype, device=x.device)
    if M == 0:
        return out
    meta = linear_meta(x.dtype)
    grid = (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]))
    bi_linear_kernel[grid](x, w, bias if bias is not None else w, out, M, N, K, x.stride(0), w.stride(0),
                           out.stride(0), HAS_BIAS=bias is not None, **meta)
    return out
