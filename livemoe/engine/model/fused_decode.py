"""The decoder's CPU step with one C++ call per layer (torch.ops.livemoe.decode_layer, csrc/decode_layer.cpp).

A small model's decode step on the CPU costs more in Python module calls and per-op dispatch than in arithmetic. The
C++ op makes a layer's calls (norms, the q/k/v/o linears, q/k-norm + RoPE, the KV store, paged attention, the router
and routed experts or the dense MLP, the residual adds) from C++, to the same kernels in the same order, so its
hidden states are bitwise those of DecoderLayer.forward (tested). It serves a paged step (decode or prefill) of a
whole model (no tensor parallel, no expert parallel) in inference on the CPU with the C++ attention backend; every
other forward takes the modules.
"""
import torch

from livemoe.engine.model.context import StepContext
from livemoe.kernels import _ext

BUILT = _ext.has_op("decode_layer")
ENABLED = True  # tests turn it off to compare against the module path


def _plain(m, plain_types: tuple[type, ...]) -> bool:
    return type(m) in plain_types and not m._forward_hooks and not m._forward_pre_hooks


def layer_call(layer, plain_types: tuple[type, ...]) -> tuple[list[torch.Tensor], int, bool] | None:
    """(weights in the order csrc/decode_layer.cpp takes them, top_k (0: dense MLP), renormalize), or None where a
    module the op stands in for is not one of plain_types (a LoRA wrapper around a linear, a subclass), has a forward
    hook (a caller watching or changing it), a bias, or experts spread over ranks. Reads the modules' dicts directly:
    this runs every step."""
    sub = layer._modules
    attn, mlp = sub["self_attn"], sub["mlp"]
    a, m = attn._modules, mlp._modules
    norms = [sub["input_layernorm"], a["q_norm"], a["k_norm"], sub["post_attention_layernorm"]]
    linears = [a["q_proj"], a["k_proj"], a["v_proj"], a["o_proj"]]
    if layer.mlp_is_moe:
        experts = m["experts"]
        if experts.expert_parallel is not None or not _plain(experts, plain_types):
            return None
        linears.append(m["gate"])
        tail = [experts._parameters["gate_up_proj"], experts._parameters["down_proj"]]
        top_k, renormalize = mlp.top_k, bool(mlp.norm_topk_prob)
    else:
        linears += [m["gate_proj"], m["up_proj"], m["down_proj"]]
        tail, top_k, renormalize = [], 0, False
    for mod in (layer, attn, mlp, a["attn"], *norms, *linears):
        if not _plain(mod, plain_types):
            return None
    for lin in linears:
        if lin._parameters.get("bias") is not None:
            return None
    w = [mod._parameters["weight"] for mod in linears]
    n = [mod._parameters["weight"] for mod in norms]
    return [n[0], w[0], w[1], w[2], w[3], n[1], n[2], n[3], *w[4:], *tail], top_k, renormalize


def plan(model, x: torch.Tensor, step: StepContext | None, plain_types: tuple[type, ...]) -> list | None:
    """Each layer's layer_call() where this forward can take the fused layers, else None (the modules run it)."""
    if not (BUILT and ENABLED and step is not None and step.backend == "auto" and x.device.type == "cpu"):
        return None
    if model.tensor_parallel is not None or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return None
    if _global_hooks() or model.model.norm.weight.dtype != x.dtype:
        return None
    calls = []
    for layer in model.model.layers:
        call = layer_call(layer, plain_types)
        if call is None:
            return None
        calls.append(call)
    return calls


def _global_hooks() -> bool:
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)


def run_layers(model, calls: list, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               step: StepContext) -> torch.Tensor:
    """x [1, N, H] through every decoder layer, one C++ call each (calls: plan()'s)."""
    eps = model.config.rms_norm_eps
    cu = None if step.is_decode else step.cu_seqlens_q
    op = torch.ops.livemoe.decode_layer
    for layer, (weights, top_k, renormalize) in zip(model.model.layers, calls):
        attn = layer.self_attn
        k_cache, v_cache = step.kv_caches[attn.attn.layer_idx]
        x = op(x, weights, k_cache, v_cache, step.slot_mapping, cu, step.context_lens, step.block_tables, cos, sin,
               attn.num_heads, attn.num_kv_heads, eps, attn.attn.scale, top_k, renormalize)
    return x
