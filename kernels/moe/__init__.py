"""Mixture-of-Experts ops: routing, routing align, and the fused expert computation.

`fused_moe` is the one entry the model calls; its inside is free to change (kernels know nothing of
models). Today it is the PyTorch reference; the Triton grouped GEMM replaces it per device.
"""
from kernels.moe.align import moe_align, moe_align_reference, num_align_blocks
from kernels.moe.reference import experts_reference, fused_moe_reference
from kernels.moe.routing import route


def fused_moe(hidden_states, w_gate_up, w_down, router_logits, top_k: int, renormalize: bool):
    """hidden_states [T, H], w_gate_up [E, 2I, H], w_down [E, H, I], router_logits [T, E] -> [T, H].

    Differentiable in all four tensors.
    """
    return fused_moe_reference(hidden_states, w_gate_up, w_down, router_logits, top_k, renormalize)


__all__ = ["fused_moe", "route", "moe_align", "moe_align_reference", "num_align_blocks",
           "experts_reference", "fused_moe_reference"]
