"""The compiled extension (csrc/, built by setup.py), if it is there.

`has_op("moe_align")` tells whether torch.ops.livemoe.moe_align can be called on this install; the
Python code falls back to PyTorch when the extension was not built.
"""
import logging

import torch

log = logging.getLogger(__name__)

try:
    from kernels import _C  # noqa: F401  (loading it registers torch.ops.livemoe.*)

    EXT_ERROR = None
except ImportError as e:  # not built (LIVEMOE_NO_EXT=1, or a source checkout without build_ext)
    _C = None
    EXT_ERROR = e
    log.debug("kernels._C not available, using PyTorch fallbacks: %s", e)


def available() -> bool:
    return _C is not None


def has_op(name: str) -> bool:
    return _C is not None and hasattr(torch.ops.livemoe, name)


def op(name: str):
    assert has_op(name), f"torch.ops.livemoe.{name} is not built ({EXT_ERROR})"
    return getattr(torch.ops.livemoe, name)


def cpu_inference(*tensors: torch.Tensor) -> bool:
    """Every tensor on the CPU and no gradient to record: where the C++ inference ops (forward only) serve."""
    for t in tensors:
        if t.device.type != "cpu":
            return False
    if torch.is_grad_enabled():
        for t in tensors:
            if t.requires_grad:
                return False
    return True
