"""`pytest bench/ --benchmark` runs the suites at full size; plain `pytest bench/` is a quick smoke mode
that CI runs so the suites cannot rot.

Our figures are in bench/out/results.{md,json,png} (printed at the end). pytest-benchmark's own table
is off by default: each suite hands its fixture one timed call (rounds=1 in quick mode and for the
minutes-long decode and serve cases), so that table would print "1 round, stddev 0" rows beside ours.
`--benchmark-enable` brings it back (with its rounds where a suite gives several)."""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # tiny_models
from fixtures import apply_device_markers, one_thread  # noqa: E402,F401  (shared fixture)


def pytest_addoption(parser):
    parser.addoption("--benchmark", action="store_true", default=False,
                     help="run the benchmark suites at full size (default: quick smoke mode)")
    parser.addoption("--benchmark-full", action="store_true", default=False,
                     help="--benchmark plus the long cases (e.g. llama.cpp at 2 threads)")
    parser.addoption("--benchmark-threads", default=None, metavar="N[,N...]",
                     help="the thread counts of the suites that take one (the llama.cpp comparison), e.g. 1,2 "
                          "(default: 1; 1,2 with --benchmark-full)")


@pytest.hookimpl(tryfirst=True)  # before -m selects
def pytest_collection_modifyitems(config, items):
    """The suites marked gpu skip without a CUDA device, saying so (markers in pyproject.toml)."""
    apply_device_markers(items, os.path.dirname(os.path.abspath(__file__)))


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    # before pytest-benchmark's own pytest_configure reads the option; --benchmark-only needs it enabled
    enable = config.getoption("benchmark_enable", default=None)
    if enable is not None and not enable and not config.getoption("benchmark_only", default=False):
        config.option.benchmark_disable = True
    from bench.common import OUT_DIR
    from bench.progress import SuiteProgress

    config.pluginmanager.register(SuiteProgress(_mode(config), OUT_DIR), "bench_progress")


def _mode(config) -> str:
    if config.getoption("benchmark_full", default=False):
        return "full+long"
    return "full" if config.getoption("--benchmark") else "quick"


@pytest.fixture(scope="session")
def bench_mode(request) -> str:
    """quick (plain `pytest bench/`) or full (--benchmark, and --benchmark-full)."""
    return "quick" if _mode(request.config) == "quick" else "full"


@pytest.fixture(scope="session")
def bench_threads(request) -> list[int]:
    """--benchmark-threads as a list; a value that is not positive integers is refused, naming it."""
    raw = request.config.getoption("--benchmark-threads")
    if raw is None:
        return [1, 2] if _mode(request.config) == "full+long" else [1]
    try:
        threads = [int(t) for t in raw.split(",")]
    except ValueError:
        threads = []
    if not threads or min(threads) < 1:
        raise pytest.UsageError(f"--benchmark-threads must be positive integers separated by commas, got {raw!r}")
    return list(dict.fromkeys(threads))


@pytest.fixture(scope="session")
def bench_long(request) -> bool:
    """--benchmark-full: the long cases too."""
    return _mode(request.config) == "full+long"


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(scope="session")
def ceilings(device, bench_mode):
    """Measured copy GB/s and bf16 GEMM TFLOP/s on a GPU (None on the CPU); recorded as rows too."""
    from bench.ceilings import measure_ceilings
    from bench.common import record

    c = measure_ceilings(device) if bench_mode == "full" else None
    if c:
        record(suite="ceiling", case="device-to-device copy", metric="GB/s", ours=c["copy_GBps"], higher_is_better=True)
        record(suite="ceiling", case="bf16 GEMM 8192^3", metric="TFLOP/s", ours=c["bf16_gemm_TFLOPs"], higher_is_better=True)
    return c


def pytest_sessionfinish(session, exitstatus):
    from bench.common import write_results

    mode = "quick" if _mode(session.config) == "quick" else "full"
    paths = write_results(mode)
    if paths:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line(f"benchmark results: {', '.join(paths)}")
            with open(paths[1]) as f:
                tr.write(f.read())
