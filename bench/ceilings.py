"""The device's ceilings, measured in the same run as the benchmarks: a large device-to-device copy for
memory bandwidth, a large bf16 GEMM for matrix throughput. Every GPU figure is reported as a fraction
of these."""
import functools

import torch

from bench.common import measure


@functools.cache  # once per process: every suite that reports a fraction of them asks
def measure_ceilings(device: str) -> dict | None:
    if torch.device(device).type != "cuda":
        return None
    copy_gbs = _copy_bandwidth(device, 1 << 30)  # 2 GiB of bf16 each way: far beyond L2
    m = 8192
    a = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=device)
    t = measure(lambda: a @ b, device, warmup=3, reps=10)
    gemm_tflops = 2 * m ** 3 / t / 1e12
    return {"copy_GBps": copy_gbs, "bf16_gemm_TFLOPs": gemm_tflops, "gpu": torch.cuda.get_device_name()}


def _copy_bandwidth(device: str, numel: int) -> float:
    src = torch.empty(numel, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    t = measure(lambda: dst.copy_(src), device, warmup=3, reps=10)
    return 2 * numel * src.element_size() / t / 1e9  # read + write
