"""`pytest bench/ --benchmark` runs the suites at full size; plain `pytest bench/` is a quick smoke mode
that CI runs so the suites cannot rot."""
import os
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))  # tiny_models


def pytest_addoption(parser):
    parser.addoption("--benchmark", action="store_true", default=False,
                     help="run the benchmark suites at full size (default: quick smoke mode)")


@pytest.fixture(scope="session")
def bench_mode(request) -> str:
    return "full" if request.config.getoption("--benchmark") else "quick"


@pytest.fixture(scope="session")
def device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def pytest_sessionfinish(session, exitstatus):
    from bench.common import write_results

    mode = "full" if session.config.getoption("--benchmark") else "quick"
    paths = write_results(mode)
    if paths:
        tr = session.config.pluginmanager.get_plugin("terminalreporter")
        if tr is not None:
            tr.write_line(f"benchmark results: {', '.join(paths)}")
            with open(paths[1]) as f:
                tr.write(f.read())
