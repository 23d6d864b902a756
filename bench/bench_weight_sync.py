"""Weight sync from a trainer to rollout engines (livemoe.engine.core.weight_sync): seconds per GB of the bucketed
broadcast at several sizes, to 1 and 2 receivers (processes of their own, as engine cores and their tensor-parallel
workers are), on gloo; and from the fit (a fixed cost plus seconds per GB) the modelled time for Qwen3-30B-A3B
and Qwen3-235B-A22B's bf16 weights. The receivers keep a copy of each tensor (what a rank's staging does), so the
figure is the transport plus the receiving side's copy.

The model for NCCL between GPUs is stated, not measured here (no GPU in this run): bytes / bus bandwidth plus the
same per-bucket count, with the bandwidth as a parameter (NVLink within a node, InfiniBand across nodes).
"""
import math
import multiprocessing
import time

import pytest
import torch

from bench.common import record
from livemoe.engine.core.weight_sync import BUCKET_BYTES, WeightReceiver, WeightSender
from livemoe.engine.net import free_port

SIZES_MIB = {"quick": [16, 64], "full": [16, 64, 256, 1024]}
TENSOR_MIB = 4  # a model is many tensors: each size is cut into 4 MiB fp32 ones
# bf16 weights (the parameter counts from livemoe plan's presets: 30.5 B and 235.1 B parameters)
MODELS_GB = {"Qwen3-30B-A3B": 61.1, "Qwen3-235B-A22B": 470.2}
NCCL_GBPS = {"NVLink (H200 node), ~350 GB/s bus": 350.0, "InfiniBand 400 Gb/s, ~45 GB/s": 45.0}


def metadata(mib: int):
    n = mib // TENSOR_MIB
    numel = TENSOR_MIB * 2**20 // 4
    return [f"t{i}" for i in range(n)], ["float32"] * n, [[numel]] * n


def receiver(port: int, rank: int, world: int, sizes: list, reps: int) -> None:
    torch.set_num_threads(1)
    r = WeightReceiver("127.0.0.1", port, rank, world, timeout_s=120)
    for mib in sizes:
        for _ in range(reps):
            kept = [t.clone() for _, t in r.receive(*metadata(mib), "cpu")]
            del kept
            r.group.barrier().wait()


def broadcast_times(receivers: int, sizes: list, reps: int) -> dict:
    """{MiB: median seconds} of one broadcast to `receivers` processes, the receivers' copies included."""
    port = free_port()
    spawn = multiprocessing.get_context("spawn")
    procs = [spawn.Process(target=receiver, args=(port, rank, receivers + 1, sizes, reps), daemon=True)
             for rank in range(1, receivers + 1)]
    for p in procs:
        p.start()
    try:
        sender = WeightSender("127.0.0.1", port, receivers + 1, timeout_s=120)
        out = {}
        for mib in sizes:
            names, _, shapes = metadata(mib)
            named = [(n, torch.randn(s[0])) for n, s in zip(names, shapes)]
            times = []
            for _ in range(reps):
                t0 = time.perf_counter()
                sender.broadcast(named)
                sender.group.barrier().wait()  # every receiver has its copy
                times.append(time.perf_counter() - t0)
            out[mib] = sorted(times)[reps // 2]
        return out
    finally:
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()


def fit(times: dict) -> tuple[float, float]:
    """Least squares seconds = fixed + per_gb * GB."""
    xs = [mib / 1024 for mib in times]
    ys = list(times.values())
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    per_gb = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-12)
    return my - per_gb * mx, per_gb


@pytest.mark.slow
def test_weight_sync_seconds_per_gb(benchmark, bench_mode, device):
    if device != "cpu":
        pytest.skip("gloo between CPU processes; on GPUs the same code uses NCCL (modelled below, not measured)")
    sizes, reps = SIZES_MIB[bench_mode], 1 if bench_mode == "quick" else 3
    for receivers in (1, 2):
        times = broadcast_times(receivers, sizes, reps)
        for mib, s in times.items():
            record(suite="weight_sync", case=f"broadcast {mib} MiB to {receivers} receiver(s), gloo", metric="s/GB",
                   ours=s / (mib / 1024), extra={"seconds": s, "MiB": mib})
        fixed, per_gb = fit(times)
        for model, gb in MODELS_GB.items():
            record(suite="weight_sync", case=f"modelled {model} ({gb} GB bf16), gloo CPU, {receivers} receiver(s)",
                   metric="s", ours=fixed + per_gb * gb, extra={"fixed_s": fixed, "s_per_GB": per_gb})
    for model, gb in MODELS_GB.items():
        num_buckets = math.ceil(gb * 1e9 / BUCKET_BYTES)
        for link, gbps in NCCL_GBPS.items():
            # a broadcast's bus time is bytes / bus bandwidth whatever the receivers (a ring); ~50 us per bucket
            record(suite="weight_sync", case=f"modelled {model} ({gb} GB bf16), NCCL over {link}", metric="s",
                   ours=gb / gbps + 50e-6 * num_buckets, extra={"buckets": num_buckets, "GBps": gbps})
    benchmark.pedantic(lambda: None, rounds=1, iterations=1)
