"""x @ weight.T for the decode step's few rows on the CPU: torch.ops.livemoe.linear (csrc/linear.cpp) reads the
weights as stored and accumulates in fp32, each weight row once for all rows. 16-bit weights take it at up to 32
rows (ATen's fp16 / bf16 CPU GEMM runs several times slower than its fp32 one), fp32 at up to 8 (it beats ATen's
GEMM there: no packing, no call chain). More rows, autograd or another device: F.linear (the reference)."""
import torch
import torch.nn.functional as F

from livemoe.kernels import _ext

_BUILT = _ext.has_op("linear")
# the most rows of x that take the C++ op, per dtype (csrc/linear.h's kSkinnyRows16 / kSkinnyRowsF32: the fused
# decode layer picks by the same rule, so both paths give the same bits)
SKINNY_ROWS = {torch.float32: 8, torch.float16: 32, torch.bfloat16: 32}


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 accumulation, rounded once to x's dtype: what the C++ op computes, to its summation order."""
    return F.linear(x.float(), weight.float()).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) without bias; the C++ op at decode sizes in CPU inference."""
    rows = SKINNY_ROWS.get(weight.dtype)
    if (_BUILT and rows is not None and x.dtype == weight.dtype and x.numel() <= rows * x.shape[-1]
            and _ext.cpu_inference(x, weight)):
        return torch.ops.livemoe.linear.default(x, weight)  # the overload itself: ~5 us less than the packet
    return F.linear(x, weight)
