"""Fixtures shared by tests/ and bench/ (both conftests import them), and helpers the tests share."""
import contextlib
import os
import subprocess
import sys

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for the module: with tiny matmuls on a shared 2-core machine, OpenMP spin-waits
    cost far more than the work (seen ~1000x), for our code and its baseline alike."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def run_with_portable_kernels(code: str) -> None:
    """Runs `code` (which prints "ok" at its end) in a fresh process with ATEN_CPU_CAPABILITY=default:
    PyTorch's switch to its portable kernels, which csrc/vec_math.h honours for ours, so the code a CPU
    without AVX2 runs (an ARM host) is tested on this one. A fresh process: the choice is made once per
    process, at the first call."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]))
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


POISON_SEED = 666  # the injected fault: sampling any batch holding this seed raises


@contextlib.contextmanager
def poisoned_sampler(llm):
    """llm's sampler raises (as a seed >= 2**64 once did, mid-step) for any batch holding POISON_SEED."""
    real = llm.sampler

    def sampler(logits, params, generators, seqs=None):
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("Overflow when unpacking long long")
        return real(logits, params, generators, seqs)

    llm.sampler = sampler
    try:
        yield
    finally:
        llm.sampler = real


async def collect_deltas(gen):
    """An async generator of StreamDeltas drained: (token ids, text, the deltas)."""
    deltas = [d async for d in gen]
    return [t for d in deltas for t in d.token_ids], "".join(d.text for d in deltas), deltas


async def wait_idle(engine, wait_s: float = 30.0):
    """Waits until an AsyncLLM has no request and no KV block in use -> its stats; fails after wait_s."""
    import asyncio

    for _ in range(int(wait_s / 0.01)):
        s = engine.stats()
        if s["num_requests"] == 0 and s["kv_blocks_used"] == 0:
            return s
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle after {wait_s}s: {engine.stats()}")
