import os
import sys

import pytest
import torch

# Triton kernels run under the interpreter where there is no GPU; it must be set before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The shared helpers (tiny_models, fixtures, spawn_ranks, ...) live here at the top of tests/, the tests in unit/,
# integration/ and gpu/; test modules import helpers of other test modules by name, across those folders too, so a
# test file's name is unique across them.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE] + [os.path.join(HERE, d) for d in ("unit", "integration", "gpu")]
from fixtures import apply_device_markers, one_thread, row_invariant_interpreter_dot  # noqa: E402,F401  (shared fixtures)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


@pytest.hookimpl(tryfirst=True)  # before -m selects: a test under tests/gpu/ is marked gpu here
def pytest_collection_modifyitems(config, items):
    """`gpu` tests skip without a CUDA device ("needs a CUDA GPU"); bench/gpu_check.sh selects them and the Triton
    kernels' tests with -m "gpu or triton" (markers in pyproject.toml; tests/fixtures.py applies them)."""
    apply_device_markers(items, HERE)
