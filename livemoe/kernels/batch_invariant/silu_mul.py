"""Triton: the exact mode's SwiGLU product, dtype(dtype(silu(gate)) * up) per element (as csrc/batch_invariant.cpp
rounds it). Elementwise, so batch-invariant as long as every element takes the same instructions: one compiled
kernel for every size (n is not specialised on)."""
import torch
import triton
import triton.language as tl

from livemoe.kernels.batch_invariant.checks import same_dtype

BLOCK = 1024


@triton.jit(do_not_specialize=["n"])
def bi_silu_mul_kernel(g_ptr, u_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    s = (g / (1.0 + tl.exp(-g))).to(out_ptr.dtype.element_ty).to(tl.float32)
    tl.store(out_ptr + offs, (s * u).to(out_ptr.dtype.element_ty), mask=mask)


def bi_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    assert gate.shape == up.shape, (gate.shape, up.shape)
    same_dtype("bi_silu_mul", gate=gate, up=up)
    gate, up = gate.contiguous(), up.contiguous()
    out = torch.empty_like(gate)
    if gate.numel():
        bi_silu_mul_kernel[(triton.cdiv(gate.numel(), BLOCK),)](gate, up, out, gate.numel(), BLOCK=BLOCK)
    return out
