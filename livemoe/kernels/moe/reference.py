"""Plain-PyTorch MoE expert computation: the reference every MoE kernel is tested against.

SwiGLU experts held stacked: w_gate_up [E, 2I, H] (gate rows then up rows), w_down [E, H, I].
"""
import torch
import torch.nn.functional as F

from livemoe.kernels.moe.routing import route


def experts_reference(hidden_states, w_gate_up, w_down, topk_weights, topk_ids):
    """sum_j topk_weights[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)) with e = topk_ids[t, j]."""
    out = torch.zeros_like(hidden_states)
    weights = topk_weights.to(hidden_states.dtype)
    for e in torch.unique(topk_ids).tolist():
        token_idx, slot = torch.where(topk_ids == e)
        gate, up = F.linear(hidden_states[token_idx], w_gate_up[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w_down[e]) * weights[token_idx, slot, None]
        out = out.index_add(0, token_idx, y)
    return out


def fused_moe_reference(hidden_states, w_gate_up, w_down, router_logits, top_k, renormalize):
    topk_weights, topk_ids = route(router_logits, top_k, renormalize)
    return experts_reference(hidden_states, w_gate_up, w_down, topk_weights, topk_ids)
