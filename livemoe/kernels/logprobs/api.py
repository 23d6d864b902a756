"""The public entries: validation, masked-row handling and the per-device dispatch."""
import math
import os

import torch

from livemoe.kernels import batch_invariant
from livemoe.kernels.batch_invariant import ops as exact_ops
from livemoe.kernels.logprobs.from_logits import LogprobsFromLogits
from livemoe.kernels.logprobs.fused import FusedLinearLogprobs, LogprobsOptions

BACKENDS = ("triton", "chunked")
CHUNKED_TOKENS, CHUNKED_VOCAB = 256, 4096  # CPU tile: 4 MiB of fp32 (measured here: smaller tiles do less
# work but, with many more ops, lose more wall time to a busy machine)
TRITON_DZ_BYTES = 1 << 28  # the Triton backward's d-logits buffer: at most 256 MiB
TRITON_MAX_TOKENS = 1 << 15  # beyond this many tokens the backward chunks tokens too


def _triton_usable(device: torch.device) -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _check(hidden, weight, targets, temperature, mask, backend):
    if not isinstance(hidden, torch.Tensor) or not isinstance(weight, torch.Tensor) or not isinstance(targets, torch.Tensor):
        raise TypeError("hidden, weight and targets must be tensors")
    if hidden.dim() < 1 or weight.dim() != 2:
        raise ValueError(f"expected hidden [..., H] and weight [V, H], got {tuple(hidden.shape)} and {tuple(weight.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden size mismatch: hidden [..., {hidden.shape[-1]}] vs weight [V, {weight.shape[1]}]")
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"targets {tuple(targets.shape)} must have hidden's leading shape {tuple(hidden.shape[:-1])}")
    if mask is not None and tuple(mask.shape) != tuple(targets.shape):
        raise ValueError(f"mask {tuple(mask.shape)} must have the targets' shape {tuple(targets.shape)}")
    if not hidden.is_floating_point() or hidden.dtype != weight.dtype:
        raise ValueError(f"hidden and weight must share one floating dtype, got {hidden.dtype} and {weight.dtype}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    if hidden.device != weight.device or hidden.device != targets.device:
        raise ValueError(f"hidden, weight, targets on different devices: {hidden.device}, {weight.device}, {targets.device}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if weight.shape[0] == 0:
        raise ValueError("weight has an empty vocabulary")
    if backend is not None and backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")


def _check_target_range(targets, vocab: int) -> None:
    """A host sync: done on the CPU only (on CUDA an out-of-range id silently gives -lse)."""
    if targets.device.type == "cpu" and targets.numel():
        lo, hi = int(targets.min()), int(targets.max())
        if lo < 0 or hi >= vocab:
            raise ValueError(f"target ids must be in [0, {vocab}), got min {lo} max {hi} "
                             "(pass ignore_index= or mask= to skip padding)")


def fused_linear_logprobs(hidden, weight, targets, temperature: float = 1.0, *, return_lse: bool = False,
                          return_entropy: bool = False, mask=None, ignore_index: int | None = None,
                          backend: str | None = None, chunk_tokens: int | None = None,
                          chunk_vocab: int | None = None, fp32_accumulation: bool = True, vocab_splits=None):
    """Log-prob of each target token under softmax(hidden @ weight.T / temperature), in fp32.

    hidden [..., H], weight [V, H] (the lm_head), targets [...] int -> logprobs [...] fp32, plus lse [...]
    (logsumexp of the scaled logits) and entropy [...] when asked, returned as a tuple in that order.
    Differentiable in hidden and weight (also through lse and entropy). Never builds [N, V]: working
    memory is bounded by one chunk of tokens x vocabulary.

    Rows where `mask` is False or targets == `ignore_index` give 0 and get no gradient; they are moved
    out of the matmuls (on the CPU by compaction, a host sync; on CUDA by sorting the active rows first
    and passing their count on the device, no host sync). Without mask/ignore_index every row is
    active; callers that already hold only the active rows should pass just those.

    backend: "triton" (default on CUDA; on the CPU only under TRITON_INTERPRET=1) or "chunked" (default
    on the CPU). chunk_tokens / chunk_vocab size the tiles (Triton: the backward's d-logits chunk);
    fp32_accumulation keeps the partial sums of d hidden / d weight in fp32 (Triton backend; the chunked
    one always does).
    """
    hidden, weight = _autocast(hidden, weight)
    _check(hidden, weight, targets, temperature, mask, backend)
    if backend is None:
        backend = "triton" if hidden.device.type == "cuda" and _triton_usable(hidden.device) else "chunked"
    if backend == "triton" and not _triton_usable(hidden.device):
        raise ValueError("backend='triton' needs triton and a CUDA tensor (or TRITON_INTERPRET=1 on the CPU)")
    size = weight.shape[1]
    shape = targets.shape
    h2 = hidden.reshape(-1, size)
    t2 = targets.reshape(-1).long()
    if h2.shape[0] == 0:
        backend = "chunked"  # nothing to launch
    if backend == "triton":  # the backward's d-logits buffer [chunk_tokens, chunk_vocab] fits TRITON_DZ_BYTES
        elt = hidden.element_size()
        chunk_tokens = chunk_tokens or min(max(h2.shape[0], 1), TRITON_MAX_TOKENS)
        chunk_vocab = chunk_vocab or max(128, TRITON_DZ_BYTES // (chunk_tokens * elt))
    else:
        chunk_vocab = chunk_vocab or CHUNKED_VOCAB
        # a small vocabulary takes more tokens per tile (fewer ops, same tile size)
        tile = CHUNKED_TOKENS * CHUNKED_VOCAB
        chunk_tokens = chunk_tokens or max(CHUNKED_TOKENS, tile // min(weight.shape[0], chunk_vocab))
    if chunk_tokens < 1 or chunk_vocab < 1:
        raise ValueError(f"chunk_tokens and chunk_vocab must be >= 1, got {chunk_tokens}, {chunk_vocab}")
    opts = LogprobsOptions(backend, chunk_tokens, chunk_vocab, fp32_accumulation, return_entropy, vocab_splits)
    weight = weight.contiguous()

    if batch_invariant.enabled():  # the exact mode: the decoder's raw log-probs to the bit
        active = None if mask is None else mask.reshape(-1).bool()
        if ignore_index is not None:
            active = (t2 != ignore_index) if active is None else active & (t2 != ignore_index)
        outs = exact_ops.linear_logprobs(h2, weight, t2, float(temperature), active)
    else:
        with torch.autocast(hidden.device.type, enabled=False):  # the kernels choose their own precision
            outs = _apply(h2, weight, t2, float(temperature), opts, mask, ignore_index, return_entropy)
    logprobs, lse, entropy = outs
    logprobs = logprobs.view(shape)
    if not (return_lse or return_entropy):
        return logprobs
    result = (logprobs,)
    if return_lse:
        result += (lse.view(shape),)
    if return_entropy:
        result += (entropy.view(shape),)
    return result


def _autocast(hidden, weight):
    """Under autocast both operands go to the autocast dtype, as F.linear's would (differentiably)."""
    device = hidden.device.type
    if torch.is_autocast_enabled(device) and hidden.is_floating_point() and weight.is_floating_point():
        dtype = torch.get_autocast_dtype(device)
        return hidden.to(dtype), weight.to(dtype)
    return hidden, weight


def _apply(h2, weight, t2, temperature, opts, mask, ignore_index, return_entropy):
    """(logprobs, lse, entropy) [N] for flat rows, inactive rows dropped before the kernels."""
    vocab = weight.shape[0]
    if mask is None and ignore_index is None:
        _check_target_range(t2, vocab)
        return FusedLinearLogprobs.apply(h2.contiguous(), weight, t2, None, temperature, opts)
    active = torch.ones_like(t2, dtype=torch.bool)
    if mask is not None:
        active &= mask.reshape(-1).to(device=t2.device, dtype=torch.bool)
    if ignore_index is not None:
        active &= t2 != ignore_index
    if opts.backend == "chunked":
        rows = active.nonzero().squeeze(1)
        t_active = t2.index_select(0, rows)
        _check_target_range(t_active, vocab)
        inner = FusedLinearLogprobs.apply(h2.index_select(0, rows), weight, t_active, None, temperature, opts)
    else:
        rows = torch.argsort((~active).to(torch.int8), stable=True)  # active rows first
        n_valid = active.sum().to(torch.int32).reshape(1)
        t_sorted = torch.where(active, t2, 0).index_select(0, rows)
        inner = FusedLinearLogprobs.apply(h2.index_select(0, rows), weight, t_sorted, n_valid, temperature, opts)

    def scatter(x):  # back to the callers' row order, 0 on inactive rows (differentiable in x)
        return x.new_zeros(t2.shape[0]).index_copy(0, rows, x)

    return scatter(inner[0]), scatter(inner[1]), scatter(inner[2]) if return_entropy else inner[2]


def logprobs_from_logits(logits, targets, temperature: float = 1.0, *, ignore_index: int | None = None):
    """Log-prob of each target under softmax(logits / temperature): logits [..., V], targets [...] ->
    [...] fp32, differentiable in logits. Works on row chunks, so no fp32 copy of the logits is made.
    Rows with targets == ignore_index give 0 and no gradient."""
    if not isinstance(logits, torch.Tensor) or not logits.is_floating_point() or logits.dim() < 1:
        raise ValueError("logits must be a floating tensor [..., V]")
    if tuple(targets.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"targets {tuple(targets.shape)} must have the logits' leading shape {tuple(logits.shape[:-1])}")
    if targets.dtype.is_floating_point or targets.dtype == torch.bool:
        raise ValueError(f"targets must be integer token ids, got {targets.dtype}")
    if not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    t = targets.reshape(-1).long()
    ignored = None
    if ignore_index is not None:
        ignored = t == ignore_index
        t = torch.where(ignored, 0, t)
    _check_target_range(t, vocab)
    out = LogprobsFromLogits.apply(flat, t, float(temperature))
    if ignored is not None:
        out = torch.where(ignored, 0.0, out)  # where() sends no gradient to the ignored rows
    return out.view(targets.shape)
