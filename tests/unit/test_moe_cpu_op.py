"""The C++ inference ops of csrc/moe_experts.cpp, the CPU path of fused_moe where no gradient is needed (the
decoder, rollouts): torch.ops.livemoe.moe_experts (given routing) and moe_forward (routing in C++ too),
against the plain references (livemoe/kernels/moe/reference.py, route()).

Tolerances:
- fp32: max abs <= 1e-5 on outputs of magnitude ~1 (same math; the GEMM summation order, the polynomial exp
  of SiLU and softmax (relative error ~1e-7) and BLAS blocking differ, each a few ulp).
- bf16/fp16 inputs: the ops widen to fp32 and round the output once, so against an fp32 reference on the same
  (rounded) inputs each element is within its dtype's unit roundoff (2^-8 bf16, 2^-11 fp16, relative) plus
  the fp32 noise above.
"""

import pytest
import torch

from fixtures import run_with_portable_kernels
from livemoe.kernels import _ext
from livemoe.kernels.moe import fused_moe, route
from livemoe.kernels.moe.reference import experts_reference, fused_moe_reference

pytestmark = pytest.mark.skipif(not _ext.has_op("moe_forward"), reason="the extension was not built "
                                "(a normal install builds it; tests/unit/test_moe_align.py fails in that case)")


def make(T, H, I, E, top_k, dtype=torch.float32, seed=0, logits=None, renormalize=True):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w_gate_up = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w_down = torch.randn(E, H, I, generator=g) / I ** 0.5
    logits = torch.randn(T, E, generator=g) if logits is None else logits
    topk_weights, topk_ids = route(logits, top_k, renormalize)
    return x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), topk_weights, topk_ids


def op(x, w_gate_up, w_down, topk_weights, topk_ids):
    return torch.ops.livemoe.moe_experts(x, w_gate_up, w_down, topk_weights, topk_ids)


def forward(x, w_gate_up, w_down, logits, top_k, renormalize=True):
    return torch.ops.livemoe.moe_forward(x, w_gate_up, w_down, logits, top_k, renormalize)


def make_routed(T, H, I, E, top_k, dtype=torch.float32, seed=0, logits=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w_gate_up = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w_down = torch.randn(E, H, I, generator=g) / I ** 0.5
    logits = torch.randn(T, E, generator=g) * 2 if logits is None else logits
    return x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), logits


# (T, H, I, E, k): one token, T < E, odd H and I (K tails of the kernel), a prime E, k = 1, k = E, many tokens,
# E = 128 with k = 8 (Qwen3-30B-A3B's routing)
CASES = [(1, 64, 32, 8, 2), (3, 97, 60, 13, 2), (7, 40, 600, 11, 1), (4, 24, 20, 5, 5), (130, 32, 24, 7, 3),
         (5, 16, 8, 128, 8)]
# segments longer than the skinny kernel's limit (32 rows) go to BLAS: every expert, or only some
LONG = [(200, 33, 17, 3, 2), (300, 24, 40, 10, 4)]


@pytest.mark.parametrize("T,H,I,E,k", CASES + LONG)
def test_experts_fp32_matches_reference(T, H, I, E, k):
    inputs = make(T, H, I, E, k, seed=T + E)
    got, want = op(*inputs), experts_reference(*inputs)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("renormalize", [True, False])
@pytest.mark.parametrize("T,H,I,E,k", CASES + LONG)
def test_forward_fp32_matches_reference(T, H, I, E, k, renormalize):
    x, w_gate_up, w_down, logits = make_routed(T, H, I, E, k, seed=2 * T + E)
    got = forward(x, w_gate_up, w_down, logits, k, renormalize)
    want = fused_moe_reference(x, w_gate_up, w_down, logits, k, renormalize)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    # the same experts as route() (torch.topk): another pick would differ by far more than rounding
    torch.testing.assert_close(got, op(x, w_gate_up, w_down, *route(logits, k, renormalize)), atol=1e-6, rtol=0)


def test_forward_skewed_routing_mixes_skinny_and_blas_segments():
    # expert 2 takes every token (a BLAS segment), the others a few each (skinny), expert 5 none
    T, E = 90, 6
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(1))
    logits[:, 2] += 20.0
    logits[:, 5] -= 40.0
    x, w_gate_up, w_down, _ = make_routed(T, 40, 28, E, 2, seed=3)
    torch.testing.assert_close(forward(x, w_gate_up, w_down, logits, 2),
                               fused_moe_reference(x, w_gate_up, w_down, logits, 2, True), atol=1e-5, rtol=0)


def test_forward_ties_prefer_the_lower_expert():
    # all logits equal: torch.topk may pick any two; moe_forward takes experts 0 and 1, weight 1/2 (renormalised)
    # or 1/6 (the probabilities)
    T, E = 5, 6
    x, w_gate_up, w_down, _ = make_routed(T, 16, 8, E, 2, seed=4)
    ids = torch.tensor([[0, 1]] * T)
    for renormalize, w in ((True, 0.5), (False, 1 / 6)):
        got = forward(x, w_gate_up, w_down, torch.zeros(T, E), 2, renormalize)
        torch.testing.assert_close(got, op(x, w_gate_up, w_down, torch.full((T, 2), w), ids), atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype,ulp", [(torch.bfloat16, 2.0 ** -8), (torch.float16, 2.0 ** -11)])
@pytest.mark.parametrize("T,E,k", [(33, 6, 2), (1, 13, 3), (80, 3, 2)])  # last: BLAS segments
def test_16bit_inputs_round_once(dtype, ulp, T, E, k):
    x, w_gate_up, w_down, logits = make_routed(T, 64, 48, E, k, dtype=dtype, seed=5)
    got = forward(x, w_gate_up, w_down, logits, k)
    want = fused_moe_reference(x.float(), w_gate_up.float(), w_down.float(), logits, k, True)
    assert got.dtype == dtype
    assert ((got.float() - want).abs() <= ulp * want.abs() + 1e-5).all()
    topk = route(logits, k, True)
    got_experts = op(x, w_gate_up, w_down, *topk)
    assert got_experts.dtype == dtype
    assert ((got_experts.float() - want).abs() <= ulp * want.abs() + 1e-5).all()


def test_bf16_large_experts():
    # experts with >= 2^20 gate||up weights and >= 3 rows: where the CPU has AVX512-BF16 they run BLAS in bf16
    # on bf16-rounded activations (transformers' bf16 numerics): within 2e-2 of the max of the fp32 reference,
    # as any bf16 computation; elsewhere the widening kernels, which pass this too
    x, w_gate_up, w_down, logits = make_routed(9, 1024, 512, 2, 1, dtype=torch.bfloat16, seed=7)
    got = forward(x, w_gate_up, w_down, logits, 1)
    want = fused_moe_reference(x.float(), w_gate_up.float(), w_down.float(), logits, 1, True)
    assert got.dtype == torch.bfloat16 and (got.float() - want).abs().max() <= 2e-2 * want.abs().max()


def test_16bit_logits():
    # bf16 logits are widened exactly; distinct values, so route() and moe_forward pick the same experts
    x, w_gate_up, w_down, _ = make_routed(12, 32, 24, 8, 2, seed=6)
    logits = (torch.arange(12 * 8).reshape(12, 8)[:, torch.randperm(8)] / 8.0).to(torch.bfloat16)
    torch.testing.assert_close(forward(x, w_gate_up, w_down, logits, 2),
                               fused_moe_reference(x, w_gate_up, w_down, logits, 2, True), atol=1e-5, rtol=0)


def test_all_tokens_to_one_expert_and_empty_batch():
    logits = torch.zeros(10, 6)
    logits[:, 4] = 30.0  # every token's top-1 is expert 4: five experts get nothing
    inputs = make(10, 24, 20, 6, 1, logits=logits)
    torch.testing.assert_close(op(*inputs), experts_reference(*inputs), atol=1e-5, rtol=0)
    torch.testing.assert_close(forward(*inputs[:3], logits, 1), experts_reference(*inputs), atol=1e-5, rtol=0)
    empty = make(0, 24, 20, 6, 2)
    assert op(*empty).shape == (0, 24)
    assert forward(*empty[:3], torch.zeros(0, 6), 2).shape == (0, 24)


@pytest.mark.parametrize("T,E,k", [(64, 8, 2), (300, 5, 2)])  # decode-sized (skinny), prefill-sized (BLAS)
def test_deterministic_and_thread_count_independent(T, E, k):
    x, w_gate_up, w_down, logits = make_routed(T, 48, 40, E, k, seed=3)
    topk = route(logits, k, True)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = forward(x, w_gate_up, w_down, logits, k), op(x, w_gate_up, w_down, *topk)
        torch.set_num_threads(2)
        two = forward(x, w_gate_up, w_down, logits, k), op(x, w_gate_up, w_down, *topk)
    finally:
        torch.set_num_threads(n)
    again = forward(x, w_gate_up, w_down, logits, k), op(x, w_gate_up, w_down, *topk)
    for a, b, c in zip(one, two, again):
        assert torch.equal(a, b) and torch.equal(a, c)


def test_portable_kernels_match_reference():
    # the code a CPU without AVX2 runs (an ARM host), here on this one (see run_with_portable_kernels)
    code = (
        "import torch, tests.unit.test_moe_cpu_op as t\n"
        "from livemoe.kernels.moe.reference import fused_moe_reference as ref\n"
        "for T, H, I, E, k in t.CASES + t.LONG:\n"
        "    for dt, tol in ((torch.float32, 1e-5), (torch.bfloat16, 2.0 ** -8)):\n"
        "        x, a, b, l = t.make_routed(T, H, I, E, k, dtype=dt, seed=T)\n"
        "        got, want = t.forward(x, a, b, l, k), ref(x.float(), a.float(), b.float(), l, k, True)\n"
        "        err = ((got.float() - want).abs() - tol * want.abs()).max().item() if T else 0.0\n"
        "        assert err <= 1e-5, (T, H, I, E, k, dt, err)\n"
        "print('ok')\n")
    run_with_portable_kernels(code)


def test_fused_moe_uses_moe_forward_without_grad_and_matches_the_autograd_path():
    x, w_gate_up, w_down, logits = make_routed(12, 32, 24, 5, 2, seed=8)
    with torch.no_grad(), torch.profiler.profile() as prof:
        fast = fused_moe(x, w_gate_up, w_down, logits, 2, True)
    names = {e.name for e in prof.events()}
    assert "livemoe::moe_forward" in names and "aten::topk" not in names
    slow = fused_moe(x, w_gate_up, w_down.requires_grad_(), logits, 2, True)  # the autograd.Function path
    assert slow.requires_grad
    torch.testing.assert_close(fast, slow.detach(), atol=1e-5, rtol=0)
    # a router that trains (logits need a gradient) also takes the autograd path
    assert fused_moe(x, w_gate_up, w_down.detach(), logits.requires_grad_(), 2, True).requires_grad
    with pytest.raises(ValueError, match="top_k"):  # route()'s error, before any C++
        with torch.no_grad():
            fused_moe(x, w_gate_up, w_down, logits, 6, True)


@pytest.mark.parametrize("bad, msg", [
    (lambda x, a, b, w, i: (x, a, b, w, i + 100), "expert id"),
    (lambda x, a, b, w, i: (x[:, :-1], a, b, w, i), "does not match"),
    (lambda x, a, b, w, i: (x, a, b.double(), w, i), "share a dtype"),
    (lambda x, a, b, w, i: (x.double(), a.double(), b.double(), w, i), "dtype must be"),
    (lambda x, a, b, w, i: (x, a, b, w[:1], i), "must both be"),
])
def test_experts_bad_input_names_the_problem(bad, msg):
    with pytest.raises(RuntimeError, match=msg):
        op(*bad(*make(4, 16, 8, 4, 2)))


@pytest.mark.parametrize("bad, msg", [
    (lambda x, a, b, l, k: (x, a, b, l, 0), r"top_k must be in \[1, num_experts = 4\], got 0"),
    (lambda x, a, b, l, k: (x, a, b, l, 5), r"top_k must be in \[1, num_experts = 4\], got 5"),
    (lambda x, a, b, l, k: (x, a, b, l[:, :3], k), r"router_logits must be \[T = 4, E = 4\]"),
    (lambda x, a, b, l, k: (x, a, b, l[:3], k), r"router_logits must be \[T = 4, E = 4\]"),
    (lambda x, a, b, l, k: (x, a, b, l.long(), k), "floating-point"),
    (lambda x, a, b, l, k: (x, a[:, :-1], b, l, k), "does not match"),
    (lambda x, a, b, l, k: (x.half(), a, b, l, k), "share a dtype"),
])
def test_forward_bad_input_names_the_problem(bad, msg):
    with pytest.raises(RuntimeError, match=msg):
        forward(*bad(*make_routed(4, 16, 8, 4, 2), 2))
