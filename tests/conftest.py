import os
import sys

import torch

# Triton kernels run under the interpreter where there is no GPU; it must be set before triton loads.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, os.path.dirname(__file__))  # tests import tiny_models
from fixtures import one_thread  # noqa: E402,F401  (shared fixture)
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


def pytest_collection_modifyitems(config, items):
    """LIVEMOE_GPU_ONLY=1 (bench/gpu_check.sh) keeps just the tests that skip without a GPU: the bf16
    real-shape checks. They are recognised by their skip reason, which names the CUDA GPU they need."""
    if os.environ.get("LIVEMOE_GPU_ONLY") != "1":
        return
    keep, drop = [], []
    for item in items:
        reasons = [m.kwargs.get("reason", "") for m in item.iter_markers("skipif")]
        (keep if any("CUDA" in r or "GPU" in r for r in reasons) else drop).append(item)
    items[:] = keep
    config.hook.pytest_deselected(items=drop)
