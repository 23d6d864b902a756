"""Whether the exact (batch-invariant) kernels run, and which: a context variable, set for one forward by its
caller (the engine core around a step when EngineConfig.batch_invariant is on, the GRPO trainer around its
forwards with --exact_rollouts) and read by the dispatching functions of livemoe.kernels and the model's layers.

A context variable and not an attribute of the model: one module serves a trainer and engines at once, from
several threads, and each caller says for itself which kernels its forward takes.

Backends: "auto" (the C++ ops of csrc/batch_invariant.cpp for CPU tensors, the Triton kernels of this package for
CUDA ones), or "triton" for every tensor (on the CPU only under TRITON_INTERPRET=1: the tests of the Triton
kernels end to end). Decoder and trainer agree bit for bit when they run the same backend on the same device.
"""
import contextlib
import contextvars
import importlib.util
import os

import torch

from livemoe.kernels import _ext

BACKENDS = ("auto", "triton")
_BACKEND: contextvars.ContextVar[str | None] = contextvars.ContextVar("livemoe_batch_invariant", default=None)
OPS = ("bi_linear", "bi_rms_norm", "bi_silu_mul", "bi_rope", "bi_attention", "bi_route", "bi_moe", "bi_log_softmax")


def enabled() -> bool:
    return _BACKEND.get() is not None


def current() -> str | None:
    """The backend of the mode in force, None outside it (what a checkpointed layer's recompute restores)."""
    return _BACKEND.get()


def uses_triton(t: torch.Tensor) -> bool:
    """Whether the exact ops take the Triton kernels for tensor t."""
    if t.device.type == "cuda":
        return True
    if _BACKEND.get() != "triton":
        return False
    if os.environ.get("TRITON_INTERPRET") != "1":
        raise ValueError(f"batch_invariant backend 'triton' on a {t.device.type} tensor needs TRITON_INTERPRET=1 "
                         "(set before triton is imported): the Triton kernels run on CUDA devices")
    return True


@contextlib.contextmanager
def batch_invariant_mode(on: bool = True, backend: str = "auto"):
    """Within it (on=True) every forward op takes its batch-invariant kernel; on=False leaves the mode as it is.
    backend "auto" inside a mode that forces "triton" keeps "triton" (a test's choice reaches the engine's steps)."""
    if backend not in BACKENDS:
        raise ValueError(f"batch_invariant backend must be one of {BACKENDS}, got {backend!r}")
    if not on:
        yield
        return
    token = _BACKEND.set(_BACKEND.get() or backend if backend == "auto" else backend)
    try:
        yield
    finally:
        _BACKEND.reset(token)


def unavailable_reason(device: torch.device | str = "cpu") -> str | None:
    """Why the exact mode cannot run on this device (None: it can)."""
    device = torch.device(device)
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            return "the batch-invariant kernels on CUDA are Triton kernels: install triton"
        return None
    if device.type != "cpu":
        return f"the batch-invariant kernels run on the CPU (C++) and on CUDA devices (Triton), not on {device}"
    missing = [name for name in OPS if not _ext.has_op(name)]
    if missing:
        return f"the batch-invariant kernels need the C++ extension (build it: python setup.py build_ext --inplace); " \
               f"missing {missing}"
    return None
