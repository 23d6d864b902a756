"""The CPU path of fused_moe (livemoe/kernels/moe/sorted_moe.py) and the public entry's dispatch and input checks.

fp32: max abs <= 1e-4 against the reference (same math, only the summation order differs).
"""
import pytest
import torch

from livemoe.kernels.moe import fused_moe
from test_moe_triton import assert_close, make_inputs, reference, run

CASES = [(1, 97, 60, 5, 2), (6, 97, 600, 13, 2), (9, 40, 24, 11, 1), (4, 24, 20, 5, 5), (64, 32, 24, 3, 2)]


@pytest.mark.parametrize("T,H,I,E,top_k", CASES)
def test_fp32_forward_and_all_grads_match_reference(T, H, I, E, top_k):
    inputs = make_inputs(T, H, I, E, seed=T + E)
    assert_close(run(inputs, top_k, backend="sorted"), reference(inputs, top_k), atol=1e-4)


def test_bf16_matches_reference():
    # bf16 on the CPU (eps 2^-8): intermediate roundings as in the reference, so within 2e-2 of the max
    inputs = make_inputs(16, 64, 48, 6, dtype=torch.bfloat16, seed=4)
    assert_close(run(inputs, 2, backend="sorted"), reference(inputs, 2), rel=2e-2)


def test_empty_experts_get_zero_weight_grads():
    logits = torch.zeros(10, 6)
    logits[:, 1] = 30.0
    inputs = make_inputs(10, 24, 20, 6, logits=logits)
    got = run(inputs, 1, backend="sorted")
    assert_close(got, reference(inputs, 1), atol=1e-4)
    assert (got[2][[0, 2, 3, 4, 5]] == 0).all() and (got[2][1] != 0).any()


def test_cpu_default_is_the_sorted_path_and_deterministic():
    inputs = make_inputs(20, 32, 24, 4, seed=2)
    a, b = run(inputs, 2), run(inputs, 2, backend="sorted")
    for x, y in zip(a, b):
        assert torch.equal(x, y)


def test_zero_tokens():
    x, w1, w2, logits = make_inputs(0, 16, 8, 4)
    assert fused_moe(x, w1, w2, logits, 2, True).shape == (0, 16)


@pytest.mark.parametrize("bad,match", [
    (dict(x=torch.randn(3, 5, 16)), "hidden_states must be"),
    (dict(w1=torch.randn(4, 15, 16)), "w_gate_up"),
    (dict(w2=torch.randn(4, 16, 7)), "w_down"),
    (dict(logits=torch.randn(3, 5)), "experts"),
    (dict(logits=torch.randn(2, 4)), "router_logits must be"),
    (dict(x=torch.randn(3, 16, dtype=torch.float64)), "share a dtype"),
    (dict(top_k=5), "top_k"),
    (dict(backend="cuda"), "backend"),
])
def test_bad_input_raises_value_error(bad, match):
    args = dict(x=torch.randn(3, 16), w1=torch.randn(4, 16, 16), w2=torch.randn(4, 16, 8), logits=torch.randn(3, 4),
                top_k=2, backend=None)
    args.update(bad)
    with pytest.raises(ValueError, match=match):
        fused_moe(args["x"], args["w1"], args["w2"], args["logits"], args["top_k"], True, backend=args["backend"])


@pytest.mark.parametrize("grouped_mm", [True, False], ids=["torch._grouped_mm", "per-expert mm"])
def test_both_matmul_paths_match_reference(monkeypatch, grouped_mm):
    from livemoe.kernels.moe import sorted_moe

    if grouped_mm and not sorted_moe._grouped_mm_works(torch.device("cpu"), torch.float32):
        pytest.skip("this torch has no torch._grouped_mm on the CPU")
    monkeypatch.setattr(sorted_moe, "_grouped_mm_works", lambda device, dtype: grouped_mm)
    inputs = make_inputs(24, 32, 16, 5, seed=9)  # strides are 16-byte multiples: _grouped_mm can take them
    assert_close(run(inputs, 2, backend="sorted"), reference(inputs, 2), atol=1e-4)


def test_triton_backend_off_cuda_needs_the_interpreter(monkeypatch):
    import livemoe.kernels.moe.triton_moe  # noqa: F401  (triton.jit picks interpreter or compiler at import: import first)

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    x, w1, w2, logits = make_inputs(3, 16, 8, 4)
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        fused_moe(x, w1, w2, logits, 2, True, backend="triton")


def test_autocast_casts_like_f_linear():
    # fp32 weights under bf16 autocast: the experts run in bf16 (as F.linear would), grads reach the fp32 leaves
    inputs = make_inputs(12, 32, 16, 4, seed=6)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = run(inputs, 2)
    assert got[0].dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in got[1:])
    assert_close(got, reference(inputs, 2), rel=3e-2)
