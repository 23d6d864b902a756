"""Whether the exact (batch-invariant) kernels run: a context variable, set for one forward by its caller (the
engine core around a step when EngineConfig.batch_invariant is on, the GRPO trainer around its forwards with
--exact_rollouts) and read by the dispatching functions of livemoe.kernels and the model's layers.

A context variable and not an attribute of the model: one module serves a trainer and engines at once, from
several threads, and each caller says for itself which kernels its forward takes.
"""
import contextlib
import contextvars

import torch

from livemoe.kernels import _ext

_ENABLED = contextvars.ContextVar("livemoe_batch_invariant", default=False)
OPS = ("bi_linear", "bi_rms_norm", "bi_silu_mul", "bi_rope", "bi_attention", "bi_route", "bi_moe", "bi_log_softmax")


def enabled() -> bool:
    return _ENABLED.get()


@contextlib.contextmanager
def batch_invariant_mode(on: bool = True):
    """Within it (on=True) every forward op takes its batch-invariant kernel; on=False leaves the mode as it is."""
    if not on:
        yield
        return
    token = _ENABLED.set(True)
    try:
        yield
    finally:
        _ENABLED.reset(token)


def unavailable_reason(device: torch.device | str = "cpu") -> str | None:
    """Why the exact mode cannot run on this device (None: it can)."""
    device = torch.device(device)
    if device.type != "cpu":
        return (f"the batch-invariant kernels run on the CPU only (device {device}); their Triton versions are "
                "not built")
    missing = [name for name in OPS if not _ext.has_op(name)]
    if missing:
        return f"the batch-invariant kernels need the C++ extension (build it: python setup.py build_ext --inplace); " \
               f"missing {missing}"
    return None
