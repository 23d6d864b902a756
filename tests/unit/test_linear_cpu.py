"""torch.ops.livemoe.linear (csrc/linear.cpp, the skinny GEMM of skinny_gemm.h) against its fp32 formula: 16-bit
weights read as stored, fp32 accumulation, one rounding of the output; fp32 too. Odd shapes (K's tail past a
multiple of 8, N not a multiple of 8 or 64), 1-32 rows, leading dims, two threads."""
import pytest
import torch

from livemoe.kernels import _ext
from livemoe.kernels.linear import linear, linear_reference

pytestmark = pytest.mark.skipif(not _ext.has_op("linear"), reason="the C++ extension (livemoe._C) is not built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows,K,N", [(1, 64, 707), (1, 13, 5), (3, 256, 130), (8, 100, 64), (32, 72, 257)])
@pytest.mark.parametrize("threads", [1, 2])
def test_linear_matches_fp32_formula(dtype, rows, K, N, threads):
    g = torch.Generator().manual_seed(rows * 1000 + K + N)
    x = torch.randn(rows, K, generator=g).to(dtype)
    w = (torch.randn(N, K, generator=g) / K ** 0.5).to(dtype)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = torch.ops.livemoe.linear(x, w)
    finally:
        torch.set_num_threads(before)
    want = linear_reference(x, w)
    assert got.dtype == dtype and got.shape == (rows, N)
    # the same fp32 products summed in another order (~K ulp of fp32), then one rounding to the dtype: at most one
    # unit of the 16-bit dtype's last place apart, and fp32 within a few ulp
    tol = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-3, atol=1e-3),
           torch.bfloat16: dict(rtol=8e-3, atol=8e-3)}[dtype]
    torch.testing.assert_close(got, want, **tol)


def test_linear_dispatch():
    w16 = torch.randn(20, 16).half()
    x = torch.randn(2, 3, 16).half()
    with torch.inference_mode():
        out = linear(x, w16)  # leading dims kept
    assert out.shape == (2, 3, 20)
    torch.testing.assert_close(out, linear_reference(x, w16), rtol=1e-3, atol=1e-3)
    wf = torch.randn(20, 16, requires_grad=True)
    y = linear(torch.randn(2, 16), wf)  # autograd: F.linear
    y.sum().backward()
    assert wf.grad is not None
    with pytest.raises(RuntimeError, match="share a dtype"):
        torch.ops.livemoe.linear(torch.randn(1, 16), w16)


@pytest.mark.parametrize("dtype,rows", [(torch.float32, 8), (torch.float16, 32)])
def test_linear_takes_the_op_up_to_its_rows(dtype, rows):
    """The module path's rule (livemoe.kernels.linear.SKINNY_ROWS) is csrc/linear.h's, which the fused CPU step takes:
    the op's bits up to `rows` rows, F.linear's above (so both paths give the same bits at every row count)."""
    g = torch.Generator().manual_seed(rows)
    w = torch.randn(300, 72, generator=g).to(dtype)
    with torch.inference_mode():
        for n in (1, rows, rows + 1):
            x = torch.randn(n, 72, generator=g).to(dtype)
            want = torch.ops.livemoe.linear(x, w) if n <= rows else torch.nn.functional.linear(x, w)
            assert torch.equal(linear(x, w), want), n


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16bit_widening_and_rounding_are_torchs(dtype):
    """The op widens x and rounds its fp32 sums with csrc/convert16.h (F16C for fp16, bit arithmetic for bf16), not
    c10's per-element conversions: the same bits as torch's .float() / .to(dtype), asserted equal. x @ [1, 1] sums
    two 16-bit values in fp32 (one add on both sides), so the outputs probe the rounding itself: ties to even,
    subnormals, overflow to inf, over enough rows (33, past the 8-wide vector loop) to take both code paths."""
    g = torch.Generator().manual_seed(7)
    finfo = torch.finfo(dtype)
    mant = torch.rand(4096, 2, generator=g) * 2 - 1
    expo = torch.randint(-30 if dtype == torch.float16 else -130, 16 if dtype == torch.float16 else 127,
                         (4096, 2), generator=g).float()
    x = (mant * torch.exp2(expo)).clamp(-finfo.max, finfo.max).to(dtype)
    x[:64, 1] = x[:64, 0] * (2 ** -11 if dtype == torch.float16 else 2 ** -8)  # sums at or near a tie
    x[64:72] = finfo.max  # overflow to inf
    w = torch.ones(1, 2, dtype=dtype)
    with torch.inference_mode():
        for rows in (x[:33], x):
            got = torch.ops.livemoe.linear(rows, w)[:, 0]
            want = (rows.float()[:, 0] + rows.float()[:, 1]).to(dtype)
            assert torch.equal(got, want)  # (the sign of a zero sum may differ: the kernel adds +0 lanes)
