"""Triton: the exact mode's rotary tables, (cos, signed_sin) [N, D] fp32 of positions [N] and inv_freq [D/2]:
cat(cos f, cos f), cat(-sin f, sin f) with f = position * inv_freq in fp32. Elementwise per (position,
frequency), one program per position: a position's row has the same bits in any batch."""
import torch
import triton
import triton.language as tl


@triton.jit
def bi_rope_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, HALF, BLOCK_H: tl.constexpr):
    n = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_H)
    mask = offs < HALF
    f = tl.load(pos_ptr + n).to(tl.float32) * tl.load(inv_ptr + offs, mask=mask, other=0.0)
    c = tl.cos(f)
    s = tl.sin(f)
    row = n * 2 * HALF
    tl.store(cos_ptr + row + offs, c, mask=mask)
    tl.store(cos_ptr + row + HALF + offs, c, mask=mask)
    tl.store(sin_ptr + row + offs, -s, mask=mask)
    tl.store(sin_ptr + row + HALF + offs, s, mask=mask)


def rope_meta(half: int) -> dict:
    return dict(BLOCK_H=triton.next_power_of_2(half))


def bi_rope(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    assert positions.dim() == 1 and inv_freq.dim() == 1, (positions.shape, inv_freq.shape)
    positions, inv_freq = positions.contiguous(), inv_freq.float().contiguous()
    half = inv_freq.shape[0]
    cos = torch.empty(positions.shape[0], 2 * half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if positions.shape[0]:
        bi_rope_kernel[(positions.shape[0],)](positions, inv_freq, cos, sin, half, **rope_meta(half))
    return cos, sin
