"""RMSNorm, and Qwen3's per-head q/k RMSNorm followed by rotate-half RoPE.

References here are transformers' formulas in PyTorch; on the CPU where no gradient is needed (the decoder,
rollouts) the C++ ops of csrc/norm_rope.cpp do the same arithmetic in one call each (a decode step of a
small model is bound by op dispatch). Training and CUDA keep the PyTorch path (autograd; on a GPU the
decode step is a CUDA graph, so dispatch costs nothing there).
"""
import torch
import torch.nn.functional as F

from livemoe.kernels import _ext, batch_invariant
from livemoe.kernels.batch_invariant import ops as exact_ops


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: weight * (x32 * rsqrt(mean(x32^2) + eps)).to(x.dtype), over the last dim;
    weight [D], or [..., D] broadcasting over x's last dims (several norms at once). F.rms_norm is one op and
    gives the same bits (checked in fp32 and bf16 on the CPU, with the weight inside or multiplied after)."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32 and weight.dim() == 1:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), x.shape[-1:], None, eps).to(x.dtype)


def rotate_half_reference(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1). `signed_sin` is sin with its first half
    negated, so rotate_half(x) * sin == roll(x, D/2) * signed_sin exactly (a negation is exact): 4 ops, not 6."""
    return x * cos + x.roll(x.shape[-1] // 2, dims=-1) * signed_sin


_BUILT = {name: _ext.has_op(name) for name in ("rms_norm", "qk_norm_rope")}  # looked up once, not per call


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm_reference's result; the C++ op where it serves (weight [D] of x's dtype)."""
    if batch_invariant.enabled():
        return exact_ops.exact(lambda x, w: exact_ops.rms_norm_forward(x, w, eps),
                               lambda x, w: rms_norm_reference(x, w, eps), x, weight)
    if _BUILT["rms_norm"] and weight.dim() == 1 and weight.dtype == x.dtype and _ext.cpu_inference(x, weight):
        return torch.ops.livemoe.rms_norm(x, weight, eps)
    return rms_norm_reference(x, weight, eps)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
                 cos: torch.Tensor, signed_sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head RMSNorm of q [..., Hq, D] and k [..., Hkv, D] (weights [D]), then RoPE with cos / signed_sin
    [..., 1, D] (see rotate_half_reference). Each head row is normalised on its own, so the bits are those of
    norming q and k apart; in PyTorch the heads of both are normed and rotated at once (2 ops, not 4)."""
    if batch_invariant.enabled():  # the exact RMSNorm; the rotation is products and sums, exact per element
        return (rotate_half_reference(rms_norm(q, q_weight, eps), cos, signed_sin),
                rotate_half_reference(rms_norm(k, k_weight, eps), cos, signed_sin))
    if _BUILT["qk_norm_rope"] and q.dtype == k.dtype == q_weight.dtype == k_weight.dtype == cos.dtype == \
            signed_sin.dtype and _ext.cpu_inference(q, k, q_weight, k_weight):
        return torch.ops.livemoe.qk_norm_rope(q, k, q_weight, k_weight, cos, signed_sin, eps)
    hq = q.shape[-2]
    weight = torch.cat((q_weight.expand(hq, -1), k_weight.expand(k.shape[-2], -1)))
    qk = rotate_half_reference(rms_norm_reference(torch.cat((q, k), dim=-2), weight, eps), cos, signed_sin)
    return qk[..., :hq, :], qk[..., hq:, :]
