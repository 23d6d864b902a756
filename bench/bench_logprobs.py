"""Fused linear log-probs against eager (logits = hidden @ W.T -> float -> log_softmax -> gather):
forward, backward and total time, and peak memory of forward+backward, in one process.

Peak memory is what the step allocates above its inputs (the [V, H] d weight it returns included, for
both): on CUDA the allocator's peak; on the CPU the process's peak resident set, reset before each
step through /proc/self/clear_refs (Linux). CPU: fp32 through the chunked path; GPU: bf16 through
Triton at N = 8x1024, H = 2048, V = 151,936. On a shared CPU wall time swings with the neighbours'
load, so CPU rows also give process CPU time (the work done, both threads summed). GPU time rows carry
the roofline model's time (bench/roofline.py) for their measured / predicted column.
"""
import time

import torch

from bench.common import measure, peak_memory, record
from bench.roofline import logprobs_pass, predict_s
from livemoe.kernels.logprobs import fused_linear_logprobs

SHAPES = {  # (N, H, V)
    ("quick", "cpu"): [(256, 64, 32_768)],
    ("full", "cpu"): [(512, 128, 151_936)],  # the real vocab; 1024 rows took ~3 of pytest bench/ --benchmark's minutes
    ("quick", "cuda"): [(1024, 2048, 151_936)],
    ("full", "cuda"): [(8 * 1024, 2048, 151_936)],
}


def eager_logprobs(hidden, weight, targets, temperature=1.0):
    logits = (hidden @ weight.t()).float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, targets[:, None]).squeeze(-1)


def cpu_time(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.process_time()
        fn()
        times.append(time.process_time() - t0)
    return min(times)


def inputs(n, h, v, dtype, device):
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(device=device, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g) / h ** 0.5).to(device=device, dtype=dtype).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g).to(device)
    upstream = torch.randn(n, generator=g).to(device)
    return hidden, weight, targets, upstream


def steps(fn, hidden, weight, targets, upstream):
    def forward():
        return fn(hidden, weight, targets)

    def total():
        hidden.grad = weight.grad = None
        (fn(hidden, weight, targets) * upstream).sum().backward()
        hidden.grad = weight.grad = None

    return forward, total


def test_fused_linear_logprobs(benchmark, bench_mode, device):
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    reps = 2 if bench_mode == "quick" else (5 if device == "cuda" else 3)
    for n, h, v in SHAPES[(bench_mode, device)]:
        hidden, weight, targets, upstream = inputs(n, h, v, dtype, device)
        with torch.no_grad():  # same answer before timing anything
            diff = (fused_linear_logprobs(hidden, weight, targets) - eager_logprobs(hidden, weight, targets)).abs().max()
        assert diff.item() <= (5e-2 if dtype == torch.bfloat16 else 1e-3), f"fused differs from eager by {diff.item()}"
        case = f"N={n} H={h} V={v} {str(dtype)[6:]}"
        times = {}
        for name, fn in (("ours", fused_linear_logprobs), ("eager", eager_logprobs)):
            forward, total = steps(fn, hidden, weight, targets, upstream)
            t_fwd = measure(forward, device, warmup=1, reps=reps)
            t_total = measure(total, device, warmup=1, reps=reps)
            mem = peak_memory(total, device)
            times[name] = (t_fwd, max(t_total - t_fwd, 0.0), t_total, mem)
            if device == "cpu":
                times[name + " cpu"] = (cpu_time(forward, reps), cpu_time(total, reps))
        for i, what in enumerate(("fwd", "bwd", "fwd+bwd")):
            model = 1e3 * predict_s(logprobs_pass(n, v, h, what, dtype.itemsize)) if device == "cuda" else None
            record(suite="logprobs", case=f"{what} {case}", metric="ms", ours=1e3 * times["ours"][i],
                   baseline=1e3 * times["eager"][i], baseline_name="eager log_softmax+gather", model=model)
        if device == "cpu":
            for i, what in enumerate(("fwd", "fwd+bwd")):
                record(suite="logprobs", case=f"{what} {case}", metric="cpu ms", ours=1e3 * times["ours cpu"][i],
                       baseline=1e3 * times["eager cpu"][i], baseline_name="eager log_softmax+gather")
        if times["ours"][3] is not None:
            record(suite="logprobs", case=f"peak mem fwd+bwd {case}", metric="MiB", ours=times["ours"][3] / 2 ** 20,
                   baseline=times["eager"][3] / 2 ** 20, baseline_name="eager log_softmax+gather")
            # less the gradients both must return (d hidden, d weight): the activation memory proper
            grads = (hidden.numel() + weight.numel()) * hidden.element_size()
            record(suite="logprobs", case=f"peak activation mem fwd+bwd {case}", metric="MiB",
                   ours=max(times["ours"][3] - grads, 1) / 2 ** 20, baseline=max(times["eager"][3] - grads, 1) / 2 ** 20,
                   baseline_name="eager log_softmax+gather")
        last = (hidden, weight, targets, upstream)
    _, total = steps(fused_linear_logprobs, *last)
    if bench_mode == "quick":
        benchmark.pedantic(total, rounds=1, iterations=1)
    else:
        benchmark.pedantic(total, rounds=reps, iterations=1, warmup_rounds=1)
