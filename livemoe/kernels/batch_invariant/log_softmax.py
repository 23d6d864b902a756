"""Triton: the exact mode's log-softmax of fp32 logits [M, V], one program per row: the row's max (exact in any
order), then sum exp(x - max) over the vocabulary in BLOCK_V chunks from the start, one partial per lane, then
tl.sum's fixed tree; out = x - (max + log(sum)). BLOCK_V is a constant: a row's bits do not depend on M."""
import torch
import triton
import triton.language as tl

BLOCK_V = 2048


@triton.jit
def bi_log_softmax_kernel(x_ptr, out_ptr, V, stride_xm, stride_om, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_V)
    mx = tl.full([BLOCK_V], float("-inf"), tl.float32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(x_ptr + row * stride_xm + start + offs, mask=start + offs < V, other=float("-inf"))
        mx = tl.maximum(mx, x)
    m = tl.max(mx, 0)
    acc = tl.zeros([BLOCK_V], tl.float32)
    for start in range(0, V, BLOCK_V):
        x = tl.load(x_ptr + row * stride_xm + start + offs, mask=start + offs < V, other=float("-inf"))
        acc += tl.exp(x - m)
    lse = m + tl.log(tl.sum(acc, 0))
    for start in range(0, V, BLOCK_V):
        mask = start + offs < V
        x = tl.load(x_ptr + row * stride_xm + start + offs, mask=mask, other=0.0)
        tl.store(out_ptr + row * stride_om + start + offs, x - lse, mask=mask)


def bi_log_softmax(x: torch.Tensor) -> torch.Tensor:
    """x [M, V] fp32 -> log_softmax over V."""
    assert x.dim() == 2 and x.dtype == torch.float32, (x.shape, x.dtype)
    x = x.contiguous()
    out = torch.empty_like(x)
    if x.shape[0]:
        bi_log_softmax_kernel[(x.shape[0],)](x, out, x.shape[1], x.stride(0), out.stride(0), BLOCK_V=BLOCK_V,
                                             num_warps=8)
    return out
