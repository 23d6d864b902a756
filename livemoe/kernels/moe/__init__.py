"""Mixture-of-Experts ops: routing, routing align, and the fused expert computation.

`fused_moe` is the one entry the model calls (`fused_experts`, its expert half, serves the expert-parallel
layer, whose tokens arrive routed); kernels know nothing of models. Backends:
  "triton"    the Triton grouped GEMMs (triton_moe.py): the CUDA default; on the CPU only under
              TRITON_INTERPRET=1, for tests
  "sorted"    sort once, per-expert matmuls on contiguous segments (sorted_moe.py): the CPU default; where
              no gradient is needed, routing and experts in one C++ call (moe_forward, csrc/moe_experts.cpp)
  "reference" the plain per-expert loop (reference.py)
Block sizes: configs.py (heuristic, per-GPU JSON cache, autotune; `python -m livemoe.kernels.moe.tune`).
"""
import torch

from livemoe.kernels import batch_invariant
from livemoe.kernels.batch_invariant import ops as exact_ops
from livemoe.kernels.moe.align import moe_align
from livemoe.kernels.moe.align_reference import moe_align_reference, num_align_blocks
from livemoe.kernels.moe.configs import MoEConfig
from livemoe.kernels.moe.reference import experts_reference, fused_moe_reference
from livemoe.kernels.moe.routing import check_replay, check_top_k, route, select_experts
from livemoe.kernels.moe.sorted_moe import cpu_inference

BACKENDS = ("triton", "sorted", "reference")


def default_backend(device: torch.device) -> str:
    return "triton" if device.type == "cuda" else "sorted"


def check_inputs(hidden_states, w_gate_up, w_down, router_logits):
    """ValueError naming the problem for inputs the kernels cannot take."""
    if hidden_states.dim() != 2:
        raise ValueError(f"hidden_states must be [T, H], got shape {tuple(hidden_states.shape)}")
    if w_gate_up.dim() != 3 or w_down.dim() != 3:
        raise ValueError(f"w_gate_up must be [E, 2I, H] and w_down [E, H, I], got {tuple(w_gate_up.shape)} "
                         f"and {tuple(w_down.shape)}")
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, h1 = w_gate_up.shape
    if h1 != hidden or two_i % 2:
        raise ValueError(f"w_gate_up {tuple(w_gate_up.shape)} does not match [E, 2I, H] with H={hidden}")
    if tuple(w_down.shape) != (num_experts, hidden, two_i // 2):
        raise ValueError(f"w_down {tuple(w_down.shape)} does not match [E, H, I] = {(num_experts, hidden, two_i // 2)}")
    if router_logits.dim() != 2 or router_logits.shape[0] != num_tokens:
        raise ValueError(f"router_logits must be [T={num_tokens}, E], got {tuple(router_logits.shape)}")
    if router_logits.shape[1] != num_experts:
        raise ValueError(f"router_logits has {router_logits.shape[1]} experts, the weights {num_experts}")
    if not (hidden_states.dtype == w_gate_up.dtype == w_down.dtype):
        raise ValueError(f"hidden_states, w_gate_up and w_down must share a dtype, got {hidden_states.dtype}, "
                         f"{w_gate_up.dtype}, {w_down.dtype}")


def _autocast_inputs(hidden_states, w_gate_up, w_down):
    """The expert matmuls cast as F.linear would under autocast."""
    device_type = hidden_states.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return tuple(t.to(dtype) for t in (hidden_states, w_gate_up, w_down))
    return hidden_states, w_gate_up, w_down


def _check_backend(backend: str | None, device: torch.device) -> str:
    backend = backend or default_backend(device)
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def fused_moe(hidden_states, w_gate_up, w_down, router_logits, top_k: int, renormalize: bool, *,
              topk_ids: torch.Tensor | None = None, backend: str | None = None, config: MoEConfig | None = None):
    """hidden_states [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], router_logits [T, E] -> [T, H].

    Differentiable in all four tensors (the router trains through the kept routing weights). topk_ids [T, k]:
    replay these experts (routing.route). `backend` forces one implementation (tests); `config` forces the
    Triton block sizes (tests, tuning).
    """
    hidden_states, w_gate_up, w_down = _autocast_inputs(hidden_states, w_gate_up, w_down)
    check_inputs(hidden_states, w_gate_up, w_down, router_logits)
    if batch_invariant.enabled():
        return fused_moe_exact(hidden_states, w_gate_up, w_down, router_logits, top_k, renormalize, topk_ids)
    backend = _check_backend(backend, hidden_states.device)
    if backend == "sorted" and topk_ids is None and cpu_inference(hidden_states, w_gate_up, w_down, router_logits):
        check_top_k(top_k, router_logits.shape[1])  # the ValueError route() raises
        return torch.ops.livemoe.moe_forward(hidden_states, w_gate_up, w_down, router_logits, top_k, renormalize)
    topk_weights, topk_ids = route(router_logits, top_k, renormalize, topk_ids)
    return fused_experts(hidden_states, w_gate_up, w_down, topk_weights, topk_ids, backend=backend, config=config)


def fused_moe_exact(hidden_states, w_gate_up, w_down, router_logits, top_k: int, renormalize: bool,
                    topk_ids: torch.Tensor | None = None):
    """fused_moe in the exact mode (livemoe.kernels.batch_invariant): the routing and the experts' values of the
    batch-invariant kernels (the same weights for replayed experts that the router would pick itself), the
    gradients of route and fused_experts."""
    check_top_k(top_k, router_logits.shape[1])
    if topk_ids is not None:
        check_replay(topk_ids, router_logits.shape[0], top_k, router_logits.shape[1])
    ids = exact_ops.route(router_logits, top_k, renormalize, topk_ids)[1]
    weights = exact_ops.exact(lambda x: exact_ops.route(x, top_k, renormalize, ids)[0],
                              lambda x: route(x, top_k, renormalize, ids)[0], router_logits)
    return exact_ops.exact(lambda *t: exact_ops.experts_forward(*t, ids),
                           lambda *t: fused_experts(*t, ids, backend="sorted"), hidden_states, w_gate_up, w_down, weights)


def fused_experts(hidden_states, w_gate_up, w_down, topk_weights, topk_ids, *, backend: str | None = None,
                  config: MoEConfig | None = None):
    """The expert half of fused_moe, for tokens already routed (topk_weights [T, k], topk_ids [T, k] into
    the E experts given): the expert-parallel layer runs its local experts on the tokens it receives."""
    hidden_states, w_gate_up, w_down = _autocast_inputs(hidden_states, w_gate_up, w_down)
    backend = _check_backend(backend, hidden_states.device)
    if hidden_states.shape[0] == 0:
        return hidden_states.clone()
    if backend == "reference":
        return experts_reference(hidden_states, w_gate_up, w_down, topk_weights, topk_ids)
    if backend == "sorted":
        from livemoe.kernels.moe.sorted_moe import experts_sorted

        return experts_sorted(hidden_states, w_gate_up, w_down, topk_weights, topk_ids)
    from livemoe.kernels.moe.triton_moe import experts_triton

    return experts_triton(hidden_states, w_gate_up, w_down, topk_weights, topk_ids, config)


__all__ = ["fused_moe", "fused_experts", "route", "select_experts", "moe_align", "moe_align_reference", "num_align_blocks",
           "experts_reference", "fused_moe_reference", "MoEConfig", "BACKENDS"]
