"""One MoE layer (router + experts), forward and forward+backward: `fused_moe` against transformers'
Qwen3MoeSparseMoeBlock (its per-expert loop, "eager"), against the same block on `torch._grouped_mm`
(transformers' "grouped_mm" experts) where the device runs it, and against megablocks' dMoE if installed.

CPU: ratios against the loop (our CPU path is the sorted-segment one). GPU: bf16 at Qwen3-30B-A3B shapes,
time with achieved TFLOP/s and GB/s, next to the hardware floor from bench/ceilings.py (weights and
activations at copy bandwidth, FLOPs at dense bf16 GEMM rate), the time as a multiple of the roofline
model's (bench/roofline.py), plus a dense cuBLAS GEMM of the same FLOPs.
"""
import pytest
import torch
import torch.nn.functional as F

from bench.common import measure, record
from bench.roofline import moe_layer, predict_s
from livemoe.kernels.moe import fused_moe

# (T, H, I, E, k) per mode and device
SHAPES = {
    ("quick", "cpu"): [(32, 64, 32, 8, 2)],
    ("full", "cpu"): [(1, 512, 192, 32, 4), (64, 512, 192, 32, 4), (512, 512, 192, 32, 4), (16, 256, 128, 128, 8)],
    ("quick", "cuda"): [(1, 2048, 768, 128, 8), (64, 2048, 768, 128, 8)],
    ("full", "cuda"): [(1, 2048, 768, 128, 8), (7, 2048, 768, 128, 8), (64, 2048, 768, 128, 8),
                       (4096, 2048, 768, 128, 8)],
}


def hf_block(H, I, E, k, dtype, device, impl="eager"):
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k,
                         norm_topk_prob=True, experts_implementation=impl)
    torch.manual_seed(0)
    block = Qwen3MoeSparseMoeBlock(cfg)
    with torch.no_grad():
        block.gate.weight.normal_(0, 1 / H ** 0.5)
        block.experts.gate_up_proj.normal_(0, 1 / H ** 0.5)
        block.experts.down_proj.normal_(0, 1 / I ** 0.5)
    return block.to(device=device, dtype=dtype)


def loop_layer(block):
    return lambda x: block(x.unsqueeze(0))[0]  # the block takes [batch, seq, H]


def ours_layer(block, k):
    def layer(x):
        logits = F.linear(x, block.gate.weight)
        return fused_moe(x, block.experts.gate_up_proj, block.experts.down_proj, logits, k, True)
    return layer


def step(layer, x, backward: bool):
    def fn():
        if backward:
            x.grad = None
            layer(x).sum().backward()
        else:
            with torch.no_grad():
                layer(x)
    return fn


def best_times(fns: dict, device, reps: int) -> dict:
    """Min wall time of each fn, calls interleaved round by round: on a shared machine the load hits every
    contender alike, and the minimum is the least disturbed run. On the CPU with one torch thread: with
    more, a busy machine stalls the threads' rendezvous and the figures turn to noise."""
    threads = torch.get_num_threads()
    if device == "cpu":
        torch.set_num_threads(1)
    try:
        best = {name: measure(fn, device, warmup=1, reps=1) for name, fn in fns.items()}  # warm-up, compile
        rounds = max(reps, min(200, int(0.2 / max(best.values()))))  # short ops get more rounds: less noise
        for _ in range(rounds):
            for name, fn in fns.items():
                best[name] = min(best[name], measure(fn, device, warmup=0, reps=1))
    finally:
        torch.set_num_threads(threads)
    return best


def megablocks_layer(H, I, E, k, dtype, device):
    """megablocks dMoE (GLU experts) at the same shapes, or None where it is not installed."""
    try:
        from megablocks.layers.arguments import Arguments
        from megablocks.layers.dmoe import dMoE
    except ImportError:
        return None
    args = Arguments(hidden_size=H, ffn_hidden_size=I, moe_num_experts=E, moe_top_k=k, mlp_type="glu",
                     activation_fn=F.silu, bf16=dtype == torch.bfloat16, fp16=dtype == torch.float16,
                     device=device)
    moe = dMoE(args)
    return lambda x: moe(x.unsqueeze(0))[0]


def flops_and_bytes(x, block, k, backward: bool):
    """Useful FLOPs (2 * pairs * 3 * H * I per pass; backward twice the forward) and the bytes a perfect
    kernel moves (each touched expert's weights once per pass, plus activations in and out)."""
    T, H = x.shape
    I = block.experts.down_proj.shape[2]
    with torch.no_grad():
        topk = torch.topk(F.linear(x, block.gate.weight), k, dim=-1).indices
    touched = torch.unique(topk).numel()
    es = x.element_size()
    w_bytes = touched * 3 * H * I * es
    act_bytes = (2 * T * H + 2 * T * k * I) * es
    flops = 2 * T * k * 3 * H * I
    return (3 * flops, 3 * w_bytes + 3 * act_bytes) if backward else (flops, w_bytes + act_bytes)


@pytest.fixture(scope="module")
def ceilings(device):
    from bench.ceilings import measure_ceilings

    return measure_ceilings(device)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "fwd+bwd"])
def test_moe_layer(benchmark, bench_mode, device, ceilings, backward):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    reps = 2 if bench_mode == "quick" else 5
    for T, H, I, E, k in SHAPES[(bench_mode, device)]:
        loop = hf_block(H, I, E, k, dtype, device)
        x = torch.randn(T, H, dtype=dtype, device=device, requires_grad=backward)
        ours = step(ours_layer(loop, k), x, backward)
        base = step(loop_layer(loop), x, backward)
        # same answer before timing anything: relative Frobenius error (a max-abs bound over the 8M outputs of
        # T=4096 would sit near the two sides' bf16 rounding, the loop's bf16 accumulation over k included)
        with torch.no_grad():
            got, want = ours_layer(loop, k)(x).float(), loop_layer(loop)(x).float()
            rel = ((got - want).norm() / want.norm()).item()
        assert rel <= (1e-2 if dtype == torch.bfloat16 else 1e-5), f"fused_moe differs from the loop by {rel:.2e} (relative)"
        contenders = {"transformers per-expert loop": base}
        for name, make in (("transformers grouped_mm", lambda: hf_block(H, I, E, k, dtype, device, "grouped_mm")),
                           ("megablocks dMoE", lambda: megablocks_layer(H, I, E, k, dtype, device))):
            try:
                layer = make()
                if layer is None:
                    continue
                if isinstance(layer, torch.nn.Module):
                    layer.load_state_dict(loop.state_dict())
                    layer = loop_layer(layer)
                fn = step(layer, x, backward)
                fn()
                contenders[name] = fn
            except Exception as e:  # noqa: BLE001  (a baseline this device or torch cannot run is left out)
                print(f"bench_moe: {name} skipped: {type(e).__name__}: {e}"[:300])
        times = best_times({"ours": ours, **contenders}, device, reps)
        t_ours = times.pop("ours")
        case = f"{'fwd+bwd' if backward else 'fwd'} T={T} H={H} I={I} E={E} k={k} {str(dtype)[6:]}"
        extra = {}
        floor = model = None
        if device == "cuda":
            model = 1e3 * predict_s(moe_layer(T, H, I, E, k, backward, x.element_size()))
            flops, nbytes = flops_and_bytes(x.detach(), loop, k, backward)
            extra = {"TFLOPs": flops / t_ours / 1e12, "GBps": nbytes / t_ours / 1e9}
            if ceilings:
                floor = 1e3 * max(nbytes / (ceilings["copy_GBps"] * 1e9), flops / (ceilings["bf16_gemm_TFLOPs"] * 1e12))
                extra["ceilings"] = ceilings
        for name, t in times.items():
            record(suite="moe", case=case, metric="ms", ours=1e3 * t_ours, baseline=1e3 * t, baseline_name=name,
                   floor=floor, model=model, extra=extra)
        if device == "cuda" and T * k >= 4096 and not backward:
            # a dense GEMM with the same FLOPs: [T*k, H] x [H, 3I]
            a = torch.randn(T * k, H, dtype=dtype, device=device)
            b = torch.randn(H, 3 * I, dtype=dtype, device=device)
            t_dense = measure(lambda: a @ b, device, warmup=3, reps=10)
            record(suite="moe", case=case, metric="ms", ours=1e3 * t_ours, baseline=1e3 * t_dense,
                   baseline_name="dense cuBLAS GEMM, same FLOPs")
    last = SHAPES[(bench_mode, device)][-1]
    block = hf_block(*last[1:], dtype, device)
    x = torch.randn(last[0], last[1], dtype=dtype, device=device, requires_grad=backward)
    fn = step(ours_layer(block, last[4]), x, backward)
    if bench_mode == "quick":
        benchmark.pedantic(fn, rounds=1, iterations=1)
    else:
        benchmark.pedantic(fn, rounds=reps, iterations=1, warmup_rounds=1)


# CPU inference (no gradient: the decoder, rollouts, reference log-probs): (T, H, I, E, k, dtype) per mode.
# Decode: the decode benchmark's tiny model, a small MoE, Qwen3-30B-A3B's layer at T = 1 and 64; prefill: a
# 1693-token prompt of the tiny model, 2048 tokens of the small one.
CPU_INFERENCE = {
    "quick": [(64, 64, 32, 8, 2, torch.float32)],
    "full": [(64, 64, 32, 8, 2, torch.float32), (64, 256, 128, 32, 4, torch.float32),
             (1, 2048, 768, 128, 8, torch.float32), (64, 2048, 768, 128, 8, torch.float32),
             (1, 2048, 768, 128, 8, torch.bfloat16), (64, 2048, 768, 128, 8, torch.bfloat16),
             (1693, 64, 32, 8, 2, torch.float32), (2048, 256, 128, 32, 4, torch.float32)],
}


def median_times(fns: dict, rounds: int) -> dict:
    """Median wall time of each fn on one thread, calls interleaved round by round (the machine's load hits
    every contender alike)."""
    import statistics
    import time

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        times = {name: [] for name in fns}
        for fn in fns.values():
            fn()  # warm-up
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(threads)
    return {name: statistics.median(t) for name, t in times.items()}


def test_moe_cpu_inference(benchmark, bench_mode, device):
    """fused_moe on the CPU without grad (torch.ops.livemoe.moe_forward: routing and experts in one C++ call)
    against route() + the experts-only op (torch.ops.livemoe.moe_experts, the same C++ core: the difference is
    the Python routing) and against route() + the sorted PyTorch path (sorted_moe.SortedMoEFunction: ~20 ops
    per layer). Plus the routing alone: route() against the C++ routing (moe_forward minus moe_experts)."""
    if device != "cpu":
        pytest.skip("the C++ inference op is the CPU path")
    from livemoe.kernels import _ext
    from livemoe.kernels.moe import route
    from livemoe.kernels.moe.sorted_moe import SortedMoEFunction

    if not _ext.has_op("moe_forward"):
        pytest.skip("the extension was not built")
    for T, H, I, E, k, dtype in CPU_INFERENCE[bench_mode]:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(T, H, generator=g).to(dtype)
        w_gate_up = (torch.randn(E, 2 * I, H, generator=g) / H ** 0.5).to(dtype)
        w_down = (torch.randn(E, H, I, generator=g) / I ** 0.5).to(dtype)
        logits = torch.randn(T, E, generator=g).to(dtype)
        topk = route(logits, k, True)

        def ours():
            with torch.no_grad():
                return fused_moe(x, w_gate_up, w_down, logits, k, True)

        def experts_op():
            with torch.no_grad():
                return torch.ops.livemoe.moe_experts(x, w_gate_up, w_down, *route(logits, k, True))

        def sorted_torch():
            with torch.no_grad():
                w, i = route(logits, k, True)
                return SortedMoEFunction.apply(x, w_gate_up, w_down, w, i)

        want = sorted_torch().float()
        rel = ((ours().float() - want).norm() / want.norm()).item()
        assert rel <= (1e-2 if dtype != torch.float32 else 1e-5), f"moe_forward differs from the sorted path by {rel:.2e}"
        fns = {"ours": ours, "route() + moe_experts op": experts_op, "route() + sorted PyTorch path": sorted_torch}
        cost = 2 * T * k * 3 * H * I * (0.5 if dtype == torch.float32 else 1.0)  # scale rounds by work
        rounds = 3 if bench_mode == "quick" else int(min(300, max(15, 3e8 / cost)))
        times = median_times(fns, rounds)
        case = f"infer T={T} H={H} I={I} E={E} k={k} {str(dtype)[6:]}"
        for name in ("route() + moe_experts op", "route() + sorted PyTorch path"):
            record(suite="moe", case=case, metric="ms", ours=1e3 * times["ours"], baseline=1e3 * times[name],
                   baseline_name=name)
        # the routing alone: moe_forward minus moe_experts on precomputed routing, both on 8-wide experts (so
        # that the difference is not lost in the noise of the expert computation), against route()
        x8 = torch.randn(T, 8, generator=g)
        w8, d8 = torch.randn(E, 16, 8, generator=g), torch.randn(E, 8, 8, generator=g)
        times = median_times({
            "moe_forward": lambda: torch.ops.livemoe.moe_forward(x8, w8, d8, logits, k, True),
            "moe_experts": lambda: torch.ops.livemoe.moe_experts(x8, w8, d8, *topk),
            "route()": lambda: route(logits, k, True)}, 3 if bench_mode == "quick" else 200)
        record(suite="moe", case=f"routing T={T} E={E} k={k} logits {str(dtype)[6:]}", metric="ms",
               ours=1e3 * max(times["moe_forward"] - times["moe_experts"], 0.0), baseline=1e3 * times["route()"],
               baseline_name="route() (softmax, topk, renormalise)",
               extra={"note": "ours = moe_forward minus moe_experts on precomputed routing, 8-wide experts"})
    benchmark.pedantic(ours, rounds=1, iterations=1)
