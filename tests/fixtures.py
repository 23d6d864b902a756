"""Fixtures shared by tests/ and bench/ (both conftests import them), and helpers the tests share."""
import contextlib
import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request

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


@pytest.fixture(scope="module")
def row_invariant_interpreter_dot():
    """Under TRITON_INTERPRET=1 tl.dot is numpy's matmul, and its BLAS kernel may round a row by the row's place in
    the block (OpenBLAS' Haswell sgemm: rows 6 and up of a block differ from rows 0-5 in the last bit), which a GPU's
    dot instruction does not. The tests of the exact mode's row invariance run the interpreter with a dot that
    treats every row alike (products accumulated over k in order, in the accumulator's dtype), so they test our
    kernels and not the host's BLAS. Nothing changes on a GPU or with the interpreter off; fp8 and integer dots keep
    the interpreter's own."""
    if os.environ.get("TRITON_INTERPRET") != "1" or torch.cuda.is_available():
        yield
        return
    from triton.runtime import interpreter

    real = interpreter.InterpreterBuilder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data.dtype
        if a.dtype.primitive_bitwidth == 8 or b.dtype.primitive_bitwidth == 8 or acc.kind != "f":
            return real(self, a, b, d, input_precision, max_num_imprecise_acc)
        x, y = a.data.astype(acc), b.data.astype(acc)
        out = d.data.copy()
        for k in range(x.shape[-1]):
            out += x[..., k:k + 1] * y[..., k:k + 1, :]
        return interpreter.TensorHandle(out, d.dtype.scalar)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(interpreter.InterpreterBuilder, "create_dot", create_dot)
        yield


def apply_device_markers(items, folder: str) -> None:
    """The markers of pyproject.toml that say what a test needs, for the collected tests under `folder` (each conftest
    passes its own, tests/ and bench/: with both collected, each hook sees every item): a test under tests/gpu/ is
    marked gpu; without a CUDA device a gpu test skips, saying it needs one, and so does a triton test where the
    interpreter is off too (the conftests set TRITON_INTERPRET=1 where there is no GPU)."""
    gpu_folder = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu") + os.sep
    folder = os.path.abspath(folder) + os.sep
    cuda = torch.cuda.is_available()
    triton = cuda or os.environ.get("TRITON_INTERPRET") == "1"
    for item in items:
        path = str(item.path)
        if not path.startswith(folder):
            continue
        if path.startswith(gpu_folder):
            item.add_marker(pytest.mark.gpu)
        if not cuda and item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        elif not triton and item.get_closest_marker("triton"):
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU or TRITON_INTERPRET=1"))


def run_with_portable_kernels(code: str) -> None:
    """Runs `code` (which prints "ok" at its end) in a fresh process with ATEN_CPU_CAPABILITY=default:
    PyTorch's switch to its portable kernels, which csrc/vec_math.h honours for ours, so the code a CPU
    without AVX2 runs (an ARM host) is tested on this one. A fresh process: the choice is made once per
    process, at the first call."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="default", PYTHONPATH=os.pathsep.join([root, os.path.join(root, "tests")]))
    res = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip() == "ok", res.stderr[-2000:]


SERVER_EXTRAS = ("fastapi", "uvicorn", "openai")


def require_server_extras():
    """Skips the calling test (or, at import, its module) unless the HTTP server's extras and the openai client
    are installed (`pip install -e .[test]`; the GPU image lacks them) -> the openai module."""
    reason = f"needs the server extras {', '.join(SERVER_EXTRAS)} (pip install -e .[test])"
    return [pytest.importorskip(name, reason=reason) for name in SERVER_EXTRAS][-1]


POISON_SEED = 666  # the injected fault: sampling any batch holding this seed raises


@contextlib.contextmanager
def poisoned_sampler(llm):
    """llm's sampler raises (as a seed >= 2**64 once did, mid-step) for any batch holding POISON_SEED."""
    real = llm.core.sampler

    def sampler(logits, params, generators, seqs=None):
        if any(p.seed == POISON_SEED for p in params):
            raise RuntimeError("Overflow when unpacking long long")
        return real(logits, params, generators, seqs)

    llm.core.sampler = sampler
    try:
        yield
    finally:
        llm.core.sampler = real


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


def http_json(url: str, body=None, *, method: str | None = None, headers: dict | None = None,
              timeout: float = 60.0) -> tuple:
    """(status, parsed JSON body, None when empty) of one request, whatever the status: a POST of `body` as JSON
    when one is given, else a GET (`method` overrides: DELETE, a POST with no body)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("GET" if body is None else "POST"),
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, json.loads(r.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def gone(pid: int, within_s: float = 10.0) -> bool:
    """Whether process pid has exited (and been reaped) within the time."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        try:  # a zombie of ours counts as gone once reaped
            if os.waitpid(pid, os.WNOHANG)[0] == pid:
                return True
        except ChildProcessError:
            pass
        time.sleep(0.05)
    return False


def assert_stopped_on_nonfinite(code: int, err: str, out) -> None:
    """What a trainer's run that diverged (--max_nonfinite_steps 2, --keep_last 1, a checkpoint every step) left:
    exit 2 with one line on stderr, no final export, the skipped step logged with its NaN as null and the
    second in a row stopping the run before its row, and one checkpoint: the last good one, with finite weights
    (the loader refuses NaN/Inf)."""
    from livemoe.engine.model.loader import load_model
    from livemoe.train.checkpoint import resolve_resume

    assert code == 2 and "Traceback" not in err
    assert "the loss or the gradients were NaN/Inf in 2 steps in a row (--max_nonfinite_steps 2)" in err
    assert not (out / "final").exists()
    rows = [json.loads(x, parse_constant=pytest.fail) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["nonfinite_steps"] for r in rows] == [0, 1] and rows[-1]["grad_norm"] is None
    last = resolve_resume("auto", str(out / "checkpoints"))
    assert last is not None and os.listdir(out / "checkpoints") == [os.path.basename(last)]
    model = load_model(os.path.join(last, "model"), device="cpu")
    assert all(torch.isfinite(p).all() for p in model.parameters())
