"""Compiling Triton kernels for sm_90 (H100/H200) on a machine without a GPU: Triton lowers to PTX and its
bundled ptxas assembles it, so a kernel that only the interpreter accepts fails here, not on the GPU. It
runs in a subprocess, since triton.jit picks interpreter or compiler at import and this session's tests
import the kernels under TRITON_INTERPRET=1."""
import os
import subprocess
import sys

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))  # the test files run as scripts import sm90 from here
ROOT = os.path.dirname(TESTS)
NO_BACKEND = 3  # exit code of a script whose triton has no NVIDIA backend


def run_compiler(args: list[str]) -> subprocess.CompletedProcess:
    """python ARGS with the Triton compiler (not the interpreter), from the repository root."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, TESTS, env.get("PYTHONPATH", "")])
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # triton's current default, said explicitly
    return subprocess.run([sys.executable, *args], env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)


def check_compile_script(path: str) -> None:
    """Runs a test file's __main__ (script_main) and fails with its report."""
    proc = run_compiler([os.path.abspath(path)])
    if proc.returncode == NO_BACKEND:
        pytest.skip(proc.stdout.strip())
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]


def compile_family(family: str) -> list[str]:
    """Compiles every launch of one kernel family that the dispatch makes at Qwen3-30B-A3B's shapes
    (bench/kernel_launches.py), bf16 and fp32, for sm_90a, each specialised as the JIT would at launch. One
    line per problem: a kernel that does not compile, needs more shared memory than a block may have, or, in
    16-bit, spills registers to the stack."""
    from bench.kernel_launches import all_launches
    from livemoe.kernels.static_resources import measure_launch, problems

    launches = all_launches(families=(family,))
    assert launches, f"no launches listed for {family}"
    rows = [measure_launch(launch) for launch in launches]
    for r in rows:
        print(f"{r.kernel} {r.case}: {r.registers} registers, {r.stack_bytes} stack bytes, {r.shared_bytes} shared")
    return problems(rows)


def script_main(compile_all, what: str) -> None:
    """The __main__ of a compile test: compile_all() returns one line per kernel that failed."""
    try:
        from triton.backends.nvidia.compiler import CUDABackend  # noqa: F401
    except ImportError as e:
        print(f"this triton has no NVIDIA backend: {e}")
        sys.exit(NO_BACKEND)
    problems = compile_all()
    print("\n".join(problems) or f"{what} compile for sm_90a without spills")
    sys.exit(1 if problems else 0)
