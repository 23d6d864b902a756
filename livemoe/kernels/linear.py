"""x @ weight.T for the decode step's few rows on the CPU with 16-bit weights: torch.ops.livemoe.linear
(csrc/linear.cpp) reads the weights as stored and accumulates in fp32, where ATen's fp16 / bf16 CPU GEMM runs
several times slower than its fp32 one. fp32, many rows, autograd or another device: F.linear (the reference)."""
import torch
import torch.nn.functional as F

from livemoe.kernels import _ext

_BUILT = _ext.has_op("linear")
SKINNY_ROWS = 32  # up to this many rows (csrc/decode_layer.cpp's kSkinnyRows)


def linear_reference(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 accumulation, rounded once to x's dtype: what the C++ op computes, to its summation order."""
    return F.linear(x.float(), weight.float()).to(x.dtype)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F.linear(x, weight) without bias; the C++ op for 16-bit weights at decode sizes in CPU inference."""
    if (_BUILT and weight.dtype in (torch.float16, torch.bfloat16) and x.dtype == weight.dtype
            and x.numel() <= SKINNY_ROWS * x.shape[-1] and _ext.cpu_inference(x, weight)):
        return torch.ops.livemoe.linear(x, weight)
    return F.linear(x, weight)
