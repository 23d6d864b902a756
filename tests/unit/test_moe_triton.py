"""The Triton MoE kernels (livemoe/kernels/moe/triton_moe.py) against the plain per-expert reference.

On the CPU they run under TRITON_INTERPRET=1 (tests/conftest.py), fp32 and fp16 at small odd shapes; on a
GPU the same tests run the compiled kernels there (bench/gpu_check.sh selects them: -m "gpu or triton").
The bf16 tests at Qwen3-30B-A3B shapes and the CUDA-graph test need a GPU (marked gpu).

Tolerances: fp32 (TF32 off, exact fp32 dots) max abs <= 1e-4 with O(1) outputs: only summation order
differs. fp16 against the fp32 reference on the same fp16 inputs: the kernels round the pre-activations,
activations and per-pair outputs to fp16 as the fp16 reference does (eps 2^-11 each), so max abs error
<= 1e-2 of the largest reference value.
"""
import pytest
import torch

from livemoe.kernels.moe import MoEConfig, fused_moe

needs_gpu = pytest.mark.gpu
# the Triton kernels run compiled on a GPU, interpreted on the CPU; every test here runs them
triton_here = pytest.mark.triton  # skips where neither a GPU nor TRITON_INTERPRET=1 (set by conftest) is there
pytestmark = triton_here
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL = MoEConfig(16, 32, 32, group_m=2, grad_block_m=32, grad_block_n=32, grad_block_k=16)
WIDE = MoEConfig(16, 64, 64, group_m=1, grad_block_m=64, grad_block_n=64, grad_block_k=32)


def make_inputs(T, H, I, E, dtype=torch.float32, device="cpu", seed=0, logits=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=g)
    w_gate_up = torch.randn(E, 2 * I, H, generator=g) / H ** 0.5
    w_down = torch.randn(E, H, I, generator=g) / I ** 0.5
    router_logits = torch.randn(T, E, generator=g) if logits is None else logits
    return [t.to(device=device, dtype=dtype).requires_grad_() for t in (x, w_gate_up, w_down, router_logits)]


def run(inputs, top_k, renormalize=True, **kw):
    out = fused_moe(*inputs, top_k, renormalize, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out)
    return [out] + list(torch.autograd.grad(out, inputs, dout))


def reference(inputs, top_k, renormalize=True):
    ref_in = [t.detach().float().requires_grad_() for t in inputs]
    return run(ref_in, top_k, renormalize, backend="reference")


def assert_close(got, want, atol=None, rel=None):
    names = ["out", "d_hidden", "d_w_gate_up", "d_w_down", "d_router_logits"]
    for name, a, b in zip(names, got, want):
        assert a.shape == b.shape, name
        err = (a.float() - b).abs().max().item()
        bound = atol if atol is not None else rel * b.abs().max().item()
        assert err <= bound, f"{name}: max abs error {err:.3g} > {bound:.3g}"


# (T, H, I, E, top_k, config): T=1; T below the block; odd H and I; prime E; k=1; k=E; experts spanning
# several align blocks (and several BLOCK_K chunks in the weight-gradient loop); the default heuristic config
CASES = [
    (1, 97, 60, 5, 2, SMALL),
    (5, 33, 40, 7, 2, SMALL),
    pytest.param(6, 97, 600, 13, 2, WIDE, marks=pytest.mark.slow),  # ~30 s under the interpreter
    (9, 40, 24, 11, 1, SMALL),
    (4, 24, 20, 5, 5, SMALL),
    (40, 32, 24, 3, 2, SMALL),
    (12, 48, 40, 8, 2, None),
]


@pytest.mark.parametrize("T,H,I,E,top_k,config", CASES)
def test_fp32_forward_and_all_grads_match_reference(T, H, I, E, top_k, config):
    inputs = make_inputs(T, H, I, E, device=DEVICE, seed=T * 31 + E)
    assert_close(run(inputs, top_k, backend="triton", config=config), reference(inputs, top_k), atol=1e-4)


@pytest.mark.parametrize("T,H,I,E,top_k,config", [CASES[1], CASES[5]])
def test_fp16_forward_and_all_grads_match_reference(T, H, I, E, top_k, config):
    inputs = make_inputs(T, H, I, E, dtype=torch.float16, device=DEVICE, seed=7)
    assert_close(run(inputs, top_k, backend="triton", config=config), reference(inputs, top_k), rel=1e-2)


@pytest.mark.parametrize("top_k", [1, 2])
def test_all_tokens_to_one_expert_leaves_others_empty(top_k):
    T, E = 20, 6
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(3))
    logits[:, 4] += 50.0  # expert 4 always first; with k=2 the second choice varies
    inputs = make_inputs(T, 24, 20, E, device=DEVICE, logits=logits)
    got = run(inputs, top_k, backend="triton", config=SMALL)
    assert_close(got, reference(inputs, top_k), atol=1e-4)
    if top_k == 1:  # experts nobody chose get exactly zero weight gradients (their tiles are still written)
        unused = [e for e in range(E) if e != 4]
        assert (got[2][unused] == 0).all() and (got[3][unused] == 0).all()


def test_without_renormalize():
    inputs = make_inputs(8, 24, 20, 6, device=DEVICE, seed=5)
    assert_close(run(inputs, 3, renormalize=False, backend="triton", config=SMALL),
                 reference(inputs, 3, renormalize=False), atol=1e-4)


def test_run_to_run_deterministic():
    inputs = make_inputs(40, 32, 24, 3, device=DEVICE, seed=11)
    first = run(inputs, 2, backend="triton", config=SMALL)
    second = run(inputs, 2, backend="triton", config=SMALL)
    for a, b in zip(first, second):
        assert torch.equal(a, b)


def test_inference_only_does_not_need_grad():
    x, w1, w2, logits = (t.detach() for t in make_inputs(5, 24, 20, 4, device=DEVICE))
    out = fused_moe(x, w1, w2, logits, 2, True, backend="triton", config=SMALL)
    ref = fused_moe(x, w1, w2, logits, 2, True, backend="reference")
    assert not out.requires_grad and (out - ref).abs().max().item() <= 1e-4


def test_only_router_requires_grad():
    x, w1, w2, logits = make_inputs(6, 24, 20, 5, device=DEVICE)
    x, w1, w2 = x.detach(), w1.detach(), w2.detach()
    out = fused_moe(x, w1, w2, logits, 2, True, backend="triton", config=SMALL)
    (got,) = torch.autograd.grad(out.sum(), logits)
    ref = fused_moe(x, w1, w2, logits, 2, True, backend="reference")
    (want,) = torch.autograd.grad(ref.sum(), logits)
    assert (got - want).abs().max().item() <= 1e-4


# ---- GPU only ----------------------------------------------------------------------------------------

QWEN3_30B = dict(H=2048, I=768, E=128, top_k=8)


@needs_gpu
@pytest.mark.parametrize("T", [1, 7, 64, 4096])
def test_bf16_qwen3_30b_shapes_against_fp32_reference(T):
    """bf16 kernels vs the fp32 reference on the same bf16 inputs. bf16 keeps 8 bits of mantissa and the
    kernels round pre-activations, activations and per-pair outputs to bf16 (as a bf16 model does): the
    output and every gradient must be within 2e-2 of the largest reference value, and the relative
    Frobenius error within 1e-2 (3e-2 for the router logits, whose softmax backward subtracts close terms)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    c = QWEN3_30B
    inputs = make_inputs(T, c["H"], c["I"], c["E"], dtype=torch.bfloat16, device="cuda", seed=T)
    got = run(inputs, c["top_k"])  # the default dispatch: Triton on CUDA, heuristic config
    want = reference(inputs, c["top_k"])
    assert_close(got, want, rel=2e-2)
    for i, (a, b) in enumerate(zip(got, want)):
        assert ((a.float() - b).norm() / b.norm().clamp_min(1e-12)).item() <= (3e-2 if i == 4 else 1e-2)


@needs_gpu
def test_decode_step_replays_in_a_cuda_graph():
    """T <= 16 decode: no host sync anywhere on the path, so the step captures; replay on new inputs
    equals an eager call bit for bit (same kernels, deterministic)."""
    c = QWEN3_30B
    x, w1, w2, logits = (t.detach() for t in make_inputs(4, c["H"], c["I"], c["E"], dtype=torch.bfloat16,
                                                          device="cuda"))
    step = lambda: fused_moe(x, w1, w2, logits, c["top_k"], True)  # noqa: E731
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # compile and warm up outside the capture
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = step()
    x2, _, _, logits2 = make_inputs(4, c["H"], c["I"], c["E"], dtype=torch.bfloat16, device="cuda", seed=99)
    x.copy_(x2.detach())
    logits.copy_(logits2.detach())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(static_out, step())


def test_model_with_triton_kernel_matches_transformers(tmp_path, monkeypatch):
    """Model level: the engine's MoE layers on the Triton kernels (interpreter, or the GPU) still give transformers' logits
    (fp32, 1e-4 as in tests/unit/test_model_parity.py)."""
    import functools

    from livemoe import engine
    from livemoe.engine.model import layers
    from tiny_models import make_checkpoint

    calls = []

    def triton_moe(*args, **kw):
        calls.append(1)
        return fused_moe(*args, **kw, backend="triton", config=WIDE)

    monkeypatch.setattr(layers, "fused_moe", functools.wraps(fused_moe)(triton_moe))
    path, hf = make_checkpoint(tmp_path / "m", moe=True, seed=3, num_experts=7, num_experts_per_tok=2)
    model = engine.load_model(path, device=DEVICE)
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours, ref = model(ids.to(DEVICE)).cpu(), hf(ids).logits
    assert calls and (ours - ref).abs().max().item() <= 1e-4
