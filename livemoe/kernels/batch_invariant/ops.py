"""The exact forwards on the model's shapes, and `exact`, which gives a trainer the ordinary formula's gradient under
the exact forward's value.

Each function here takes tensors of any leading shape and returns what the ordinary op returns, to the bits of a
computation that looks at one row (attention: one query and its context) in one fixed order: the C++ ops
(torch.ops.livemoe.bi_*, csrc/batch_invariant.cpp) for CPU tensors, the Triton kernels of this package's
modules for CUDA ones (mode.uses_triton). The two backends round alike but sum in other orders: a CPU decoder
and a GPU trainer do not share bits; each device agrees with itself.
"""
import torch
import torch.nn.functional as F

from livemoe.kernels.batch_invariant.mode import uses_triton

OPS = torch.ops.livemoe


def _triton(name: str):
    """The Triton entry `name` (bi_linear, ...) of its module, imported on first use (a CPU install may lack triton)."""
    import importlib

    module = {"bi_linear": "linear", "bi_rms_norm": "rms_norm", "bi_silu_mul": "silu_mul", "bi_rope": "rope",
              "bi_attention": "attention", "bi_route": "route", "bi_moe": "experts",
              "bi_log_softmax": "log_softmax"}[name]
    return getattr(importlib.import_module(f"livemoe.kernels.batch_invariant.{module}"), name)


def _op(name: str, t: torch.Tensor):
    """The exact op `name` for tensor t's device (and the mode's backend)."""
    return _triton(name) if uses_triton(t) else getattr(OPS, name)


class _ExactForward(torch.autograd.Function):
    """Forward: exact_fn's value. Backward: ref_fn recomputed on the saved inputs, differentiated by autograd."""

    @staticmethod
    def forward(ctx, exact_fn, ref_fn, *tensors):
        ctx.ref_fn = ref_fn
        ctx.save_for_backward(*tensors)
        return exact_fn(*tensors)

    @staticmethod
    def backward(ctx, grad):
        needs = ctx.needs_input_grad[2:]
        inputs = [t if t is None else t.detach().requires_grad_(n) for t, n in zip(ctx.saved_tensors, needs)]
        wanted = [t for t, n in zip(inputs, needs) if n]
        with torch.enable_grad():
            out = ctx.ref_fn(*inputs)
        grads = iter(torch.autograd.grad(out, wanted, grad, allow_unused=True))
        return (None, None, *(next(grads) if n else None for n in needs))


def exact(exact_fn, ref_fn, *tensors):
    """exact_fn(*tensors); where autograd records, its gradient is ref_fn's (the ordinary formula of the same
    value), recomputed in the backward: only the forward values need to agree with the decoder's."""
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return _ExactForward.apply(exact_fn, ref_fn, *tensors)
    return exact_fn(*tensors)


def linear_forward(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear's value: x [..., K], weight [N, K] -> [..., N]."""
    out = _op("bi_linear", x)(x.reshape(-1, x.shape[-1]), weight, bias)
    return out.view(*x.shape[:-1], weight.shape[0])


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """livemoe.kernels.norm.rms_norm_reference's formula over x's last dim (weight [D])."""
    return _op("bi_rms_norm", x)(x.reshape(-1, x.shape[-1]), weight, eps).view(x.shape)


def silu_mul_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up."""
    return _op("bi_silu_mul", gate)(gate, up).view(gate.shape)


def rope_forward(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RotaryEmbedding's (cos, signed_sin) [..., 1, D] of positions [...], cast to dtype."""
    cos, sin = _op("bi_rope", positions)(positions.reshape(-1), inv_freq)
    shape = (*positions.shape, 1, cos.shape[-1])
    return cos.view(shape).to(dtype), sin.view(shape).to(dtype)


def paged_attention_forward(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale: float):
    """q [N, Hq, D] (sequence s's queries at cu_seqlens_q[s]..[s+1], the last of its context_lens[s] tokens) over a
    paged cache -> [N, Hq, D]; cu_seqlens_q None: one query per sequence (a decode step)."""
    if cu_seqlens_q is None:
        cu_seqlens_q = torch.arange(context_lens.shape[0] + 1, dtype=torch.int32, device=q.device)
    return _op("bi_attention", q)(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale)


def causal_attention_forward(q, k, v, scale: float):
    """Causal attention of q [B, T, Hq, D] over k/v [B, T, Hkv, D]: each row is a paged cache of one block of T
    tokens, so the arithmetic is the decoder's, query by query."""
    B, T = q.shape[:2]
    ints = dict(dtype=torch.int32, device=q.device)
    cu = torch.arange(0, B * T + 1, T, **ints)
    tables = torch.arange(B, **ints)[:, None]
    out = _op("bi_attention", q)(q.reshape(B * T, *q.shape[2:]), k.contiguous(), v.contiguous(), cu,
                           torch.full((B,), T, **ints), tables, scale)
    return out.view(q.shape)


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          topk_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """livemoe.kernels.moe.routing.route's (topk_weights [T, k] fp32, topk_ids [T, k] int64), the lower expert id
    first among equal probabilities; topk_ids given: those experts (replay)."""
    return _op("bi_route", router_logits)(router_logits.detach(), top_k, renormalize, topk_ids)


def experts_forward(x, w_gate_up, w_down, topk_weights, topk_ids) -> torch.Tensor:
    """livemoe.kernels.moe.fused_experts' value, token by token, the k experts summed in the order of topk_ids."""
    return _op("bi_moe", x)(x, w_gate_up, w_down, topk_weights, topk_ids)


def log_softmax(x: torch.Tensor) -> torch.Tensor:
    """x.float().log_softmax(-1) over [..., V]."""
    x = x.float()
    return _op("bi_log_softmax", x)(x.reshape(-1, x.shape[-1])).view(x.shape)


def scale_logits(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [N, V] in fp32 divided by temperature [N, 1] fp32: the one division the decoder's sampler and the
    trainer both make (a correctly rounded quotient per element)."""
    return logits.float() / temperature


def linear_logprobs(hidden, weight, targets, temperature: float, active=None):
    """livemoe.kernels.fused_linear_logprobs' (logprobs, lse, entropy) [N] of flat rows hidden [N, H] and targets
    [N], with the logits and log-softmax of the exact kernels (the decoder's raw log-probs, bit for bit) and the
    ordinary gradients; rows where `active` [N] is False give 0. Builds the [N, V] logits: the exact mode pays
    that memory for the bits."""
    logits = exact(linear_forward, F.linear, hidden, weight)
    scaled = scale_logits(logits, torch.full((hidden.shape[0], 1), temperature, dtype=torch.float32,
                                             device=hidden.device))
    lsm = exact(log_softmax, lambda x: x.log_softmax(-1), scaled)
    lp = lsm.gather(1, targets.clamp(0, weight.shape[0] - 1)[:, None])[:, 0]
    lse = scaled[:, 0] - lsm[:, 0]
    entropy = -(lsm.exp() * lsm).sum(-1)
    if active is not None:
        zero = torch.zeros((), device=lp.device)
        lp, lse, entropy = (torch.where(active, t, zero) for t in (lp, lse, entropy))
    return lp, lse, entropy
