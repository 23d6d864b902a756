"""The C++ inference op torch.ops.livemoe.moe_experts (csrc/moe_experts.cpp), the CPU path of fused_moe
where no gradient is needed (the decoder, rollouts), against the plain per-expert reference.

fp32: max abs <= 1e-5 (same math; the summation order of the k copies and BLAS blocking differ).
bf16/fp16: the op rounds once where the reference rounds after every op: within 2e-2 of the output's
max magnitude of an fp32 reference.
"""
import pytest
import torch

from kernels import _ext
from kernels.moe import fused_moe, route
from kernels.moe.reference import experts_reference

pytestmark = pytest.mark.skipif(not _ext.has_op("moe_experts"), reason="the extension was not built "
                                "(a normal install builds it; tests/test_moe_align.py fails in that case)")


def make(T, H, I, E, top_k, dtype=torch.float32, seed=0, logits=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w_gate_up = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w_down = torch.randn(E, H, I, generator=g) / I ** 0.5
    logits = torch.randn(T, E, generator=g) if logits is None else logits
    topk_weights, topk_ids = route(logits, top_k, True)
    return x.to(dtype), w_gate_up.to(dtype), w_down.to(dtype), topk_weights, topk_ids


def op(x, w_gate_up, w_down, topk_weights, topk_ids):
    return torch.ops.livemoe.moe_experts(x, w_gate_up, w_down, topk_weights, topk_ids)


# (T, H, I, E, k): one token, T < E, odd H and I, a prime E, k = 1, k = E, many tokens
CASES = [(1, 64, 32, 8, 2), (3, 97, 60, 13, 2), (7, 40, 600, 11, 1), (4, 24, 20, 5, 5), (130, 32, 24, 7, 3)]


@pytest.mark.parametrize("T,H,I,E,k", CASES)
def test_fp32_matches_reference(T, H, I, E, k):
    inputs = make(T, H, I, E, k, seed=T + E)
    got, want = op(*inputs), experts_reference(*inputs)
    assert got.dtype == torch.float32 and got.shape == (T, H)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_matches_fp32_reference(dtype):
    inputs = make(33, 64, 48, 6, 2, dtype=dtype, seed=5)
    got = op(*inputs)
    want = experts_reference(*(t.float() if t.is_floating_point() else t for t in inputs))
    assert got.dtype == dtype
    assert (got.float() - want).abs().max() <= 2e-2 * want.abs().max()


def test_all_tokens_to_one_expert_and_empty_batch():
    logits = torch.zeros(10, 6)
    logits[:, 4] = 30.0  # every token's top-1 is expert 4: five experts get nothing
    inputs = make(10, 24, 20, 6, 1, logits=logits)
    torch.testing.assert_close(op(*inputs), experts_reference(*inputs), atol=1e-5, rtol=0)
    empty = make(0, 24, 20, 6, 2)
    assert op(*empty).shape == (0, 24)


def test_deterministic_and_thread_count_independent():
    inputs = make(64, 48, 40, 8, 2, seed=3)
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = op(*inputs)
        torch.set_num_threads(2)
        two = op(*inputs)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two) and torch.equal(one, op(*inputs))


def test_fused_moe_uses_it_without_grad_and_matches_the_autograd_path():
    x, w_gate_up, w_down, _, _ = make(12, 32, 24, 5, 2, seed=8)
    logits = torch.randn(12, 5, generator=torch.Generator().manual_seed(9))
    with torch.no_grad(), torch.profiler.profile() as prof:
        fast = fused_moe(x, w_gate_up, w_down, logits, 2, True)
    assert any(e.name == "livemoe::moe_experts" for e in prof.events())
    slow = fused_moe(x, w_gate_up, w_down.requires_grad_(), logits, 2, True)  # the autograd.Function path
    assert slow.requires_grad
    torch.testing.assert_close(fast, slow.detach(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("bad, msg", [
    (lambda x, a, b, w, i: (x, a, b, w, i + 100), "expert id"),
    (lambda x, a, b, w, i: (x[:, :-1], a, b, w, i), "does not match"),
    (lambda x, a, b, w, i: (x, a, b.double(), w, i), "share a dtype"),
    (lambda x, a, b, w, i: (x, a, b, w[:1], i), "must both be"),
])
def test_bad_input_names_the_problem(bad, msg):
    with pytest.raises(RuntimeError, match=msg):
        op(*bad(*make(4, 16, 8, 4, 2)))
