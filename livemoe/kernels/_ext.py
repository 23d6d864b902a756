"""The compiled extension (csrc/, built by setup.py), if it is there.

`has_op("moe_align")` tells whether torch.ops.livemoe.moe_align can be called on this install; the
Python code falls back to PyTorch when the extension was not built.
"""
import functools
import logging

import torch

log = logging.getLogger(__name__)

try:
    from livemoe import _C  # noqa: F401  (loading it registers torch.ops.livemoe.*)

    EXT_ERROR = None
except ImportError as e:  # not built (LIVEMOE_NO_EXT=1, or a source checkout without build_ext)
    _C = None
    EXT_ERROR = e
    log.debug("livemoe._C not available, using PyTorch fallbacks: %s", e)


def available() -> bool:
    return _C is not None


def has_op(name: str) -> bool:
    return _C is not None and hasattr(torch.ops.livemoe, name)


def op(name: str):
    assert has_op(name), f"torch.ops.livemoe.{name} is not built ({EXT_ERROR})"
    return getattr(torch.ops.livemoe, name)


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device | str) -> int:
    """Streaming multiprocessors of a CUDA device, read from it (132 on an H100 SXM, 108 on an A100);
    1 elsewhere (the CPU, the Triton interpreter), where a grid runs one program at a time anyway."""
    device = torch.device(device)
    if device.type != "cuda":
        return 1
    return _cuda_sm_count(torch.cuda.current_device() if device.index is None else device.index)


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
