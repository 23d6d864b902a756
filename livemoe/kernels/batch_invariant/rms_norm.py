"""Triton: the exact mode's RMSNorm, transformers' formula per row of x [M, D]: weight * dtype(x * 1/sqrt(mean(x^2)
+ eps)), one program per row. The sum of squares runs over the row in BLOCK_D chunks from the start, one fp32
partial per lane, then tl.sum's fixed tree: BLOCK_D comes from D alone, so a row's bits do not depend on M."""
import torch
import triton
import triton.language as tl

from livemoe.kernels.batch_invariant.checks import same_dtype


@triton.jit
def bi_rms_norm_kernel(x_ptr, w_ptr, out_ptr, D, stride_xm, stride_om, eps, BLOCK_D: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_D)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, D, BLOCK_D):
        x = tl.load(x_ptr + row * stride_xm + start + offs, mask=start + offs < D, other=0.0).to(tl.float32)
        acc += x * x
    inv = 1.0 / tl.sqrt_rn(tl.sum(acc, 0) / D + eps)
    for start in range(0, D, BLOCK_D):
        mask = start + offs < D
        x = tl.load(x_ptr + row * stride_xm + start + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + start + offs, mask=mask, other=0.0).to(tl.float32)
        y = (x * inv).to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out_ptr + row * stride_om + start + offs, (w * y).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm_meta(D: int) -> dict:
    return dict(BLOCK_D=min(2048, triton.next_power_of_2(D)), num_warps=4)


def bi_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, D], w [D] of x's dtype -> [M, D]."""
    assert x.dim() == 2 and w.shape == (x.shape[1],), (x.shape, w.shape)
    same_dtype("bi_rms_norm", x=x, weight=w)
    x, w = x.contiguous(), w.contiguous()
    out = torch.empty_like(x)
    if x.shape[0]:
        bi_rms_norm_kernel[(x.shape[0],)](x, w, out, x.shape[1], x.stride(0), out.stride(0), eps,
                                          **rms_norm_meta(x.shape[1]))
    return out
