"""livemoe.kernels.norm: RMSNorm and per-head q/k RMSNorm + RoPE. The C++ ops (csrc/norm_rope.cpp, the CPU path where
no gradient is needed) against the PyTorch references, which are transformers' formulas.

Tolerances: fp32 within 2 ulp-scale (rtol 1e-6, atol 1e-6): the op sums x^2 in its SIMD order, PyTorch's
vectorised mean in another (the rest is op by op the same). 16-bit: the op rounds exactly where the
reference does, so at most one unit in the last place apart (from a different rounding of the fp32 mean):
rtol 1e-2 (bf16's ulp is 2^-7) and atol at the outputs' scale.
"""
import pytest
import torch

from livemoe.engine.model.layers import RotaryEmbedding
from livemoe.kernels import _ext
from livemoe.kernels.norm import qk_norm_rope, rms_norm, rms_norm_reference, rotate_half_reference

pytestmark = pytest.mark.skipif(not _ext.has_op("qk_norm_rope"), reason="the extension was not built "
                                "(a normal install builds it; tests/unit/test_moe_align.py fails in that case)")

TOL = {torch.float32: dict(rtol=1e-6, atol=1e-6), torch.bfloat16: dict(rtol=1e-2, atol=1e-2),
       torch.float16: dict(rtol=2e-3, atol=2e-3)}


def rand(*shape, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (7, 3, 97), (130, 8), (2, 0, 16)])
def test_rms_norm_matches_reference(shape, dtype):
    x = rand(*shape, dtype=dtype, seed=len(shape), scale=3.0)
    w = rand(shape[-1], dtype=dtype, seed=1) + 1
    got = torch.ops.livemoe.rms_norm(x, w, 1e-6)
    assert got.dtype == dtype and got.shape == x.shape
    torch.testing.assert_close(got, rms_norm_reference(x, w, 1e-6), **TOL[dtype])


def test_rms_norm_strided_input_and_eps():
    """A non-contiguous x (a column slice) and a large eps, which dominates small rows."""
    x = rand(9, 40, seed=3)[:, 5:29]
    w = rand(24, seed=4)
    for eps in (1e-6, 10.0):
        torch.testing.assert_close(torch.ops.livemoe.rms_norm(x, w, eps), rms_norm_reference(x, w, eps), **TOL[torch.float32])


def reference_qk(q, k, q_w, k_w, cos, sin, eps):
    return (rotate_half_reference(rms_norm_reference(q, q_w, eps), cos, sin),
            rotate_half_reference(rms_norm_reference(k, k_w, eps), cos, sin))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("B,T,hq,hkv,d", [(1, 1, 4, 2, 16), (2, 5, 8, 1, 6), (1, 33, 3, 3, 128)])
def test_qk_norm_rope_matches_reference(B, T, hq, hkv, d, dtype):
    rope = RotaryEmbedding(d, 10000.0)
    positions = torch.randint(0, 400, (B, T), generator=torch.Generator().manual_seed(T))
    cos, sin = rope(positions, dtype)
    q, k = rand(B, T, hq, d, dtype=dtype, seed=1, scale=2.0), rand(B, T, hkv, d, dtype=dtype, seed=2)
    q_w, k_w = rand(d, dtype=dtype, seed=3), rand(d, dtype=dtype, seed=4)
    want_q, want_k = reference_qk(q, k, q_w, k_w, cos, sin, 1e-6)
    with torch.no_grad():
        got_q, got_k = qk_norm_rope(q, k, q_w, k_w, cos, sin, 1e-6)
    assert got_q.shape == q.shape and got_k.shape == k.shape
    torch.testing.assert_close(got_q, want_q, **TOL[dtype])
    torch.testing.assert_close(got_k, want_k, **TOL[dtype])


def test_qk_norm_rope_reads_strided_views():
    """q and k as views of one fused projection output (head rows strided), as a fused qkv would give."""
    n, hq, hkv, d = 6, 4, 2, 16
    qkv = rand(n, (hq + 2 * hkv) * d, seed=5)
    q, k = qkv[:, :hq * d].view(n, hq, d), qkv[:, hq * d:(hq + hkv) * d].view(n, hkv, d)
    cos, sin = RotaryEmbedding(d, 1e6)(torch.arange(n)[None], torch.float32)
    cos, sin = cos[0], sin[0]  # [n, 1, d]
    w = rand(d, seed=6)
    got = torch.ops.livemoe.qk_norm_rope(q, k, w, w, cos, sin, 1e-6)
    want = reference_qk(q, k, w, w, cos, sin, 1e-6)
    for g, r in zip(got, want):
        torch.testing.assert_close(g, r, **TOL[torch.float32])


def test_dispatch_keeps_autograd():
    """With a gradient to record, the PyTorch path runs (the C++ ops have no backward): gradients flow and
    equal those of the reference."""
    x = rand(5, 32, seed=7).requires_grad_()
    w = (rand(32, seed=8) + 1).requires_grad_()
    rms_norm(x, w, 1e-6).square().sum().backward()
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    rms_norm_reference(x2, w2, 1e-6).square().sum().backward()
    torch.testing.assert_close(x.grad, x2.grad)
    torch.testing.assert_close(w.grad, w2.grad)
    q = rand(1, 3, 2, 8, seed=9).requires_grad_()
    k = rand(1, 3, 1, 8, seed=10)
    cos, sin = RotaryEmbedding(8, 1e4)(torch.arange(3)[None], torch.float32)
    qo, _ = qk_norm_rope(q, k, torch.ones(8), torch.ones(8), cos, sin, 1e-6)
    assert qo.requires_grad


def test_bad_input_names_the_problem():
    x, w = rand(4, 8), rand(8)
    with pytest.raises(RuntimeError, match="weight must be \\[D\\]"):
        torch.ops.livemoe.rms_norm(x, rand(7), 1e-6)
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.livemoe.rms_norm(x, w.double(), 1e-6)
    with pytest.raises(RuntimeError, match="dtype must be"):
        torch.ops.livemoe.rms_norm(x.double(), w.double(), 1e-6)
    q, k, cos = rand(3, 2, 8), rand(3, 1, 8), rand(3, 1, 8)
    with pytest.raises(RuntimeError, match="must be even"):
        torch.ops.livemoe.qk_norm_rope(rand(3, 2, 7), rand(3, 1, 7), rand(7), rand(7), rand(3, 1, 7), rand(3, 1, 7),
                                       1e-6)
    with pytest.raises(RuntimeError, match="cos and signed_sin must broadcast"):
        torch.ops.livemoe.qk_norm_rope(q, k, w, w, rand(2, 1, 8), rand(2, 1, 8), 1e-6)
    with pytest.raises(RuntimeError, match="cos and signed_sin must broadcast"):
        torch.ops.livemoe.qk_norm_rope(q, k, w, w, rand(3, 8), rand(3, 8), 1e-6)
    with pytest.raises(RuntimeError, match="same leading dims"):
        torch.ops.livemoe.qk_norm_rope(q, rand(4, 1, 8), w, w, cos, cos, 1e-6)


def test_qk_norm_rope_broadcasts_cos_over_the_batch():
    """cos / signed_sin of one row of positions [1, T, 1, D] serve a batch of B rows, as in the reference."""
    q, k = rand(3, 5, 4, 16, seed=11), rand(3, 5, 2, 16, seed=12)
    cos, sin = RotaryEmbedding(16, 1e4)(torch.arange(5)[None], torch.float32)
    w = rand(16, seed=13)
    with torch.no_grad():
        got = qk_norm_rope(q, k, w, w, cos, sin, 1e-6)
    for g, r in zip(got, reference_qk(q, k, w, w, cos, sin, 1e-6)):
        torch.testing.assert_close(g, r, **TOL[torch.float32])
