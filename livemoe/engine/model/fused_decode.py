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


def layer_weights(layer) -> list[torch.Tensor]:
    """The order csrc/decode_layer.cpp takes them in."""
    attn, mlp = layer.self_attn, layer.mlp
    w = [layer.input_layernorm.weight, attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight, attn.o_proj.weight,
         attn.q_norm.weight, attn.k_norm.weight, layer.post_attention_layernorm.weight]
    if layer.mlp_is_moe:
        w += [mlp.gate.weight, mlp.experts.gate_up_proj, mlp.experts.down_proj]
    else:
        w += [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    return w


def serves(model, x: torch.Tensor, step: StepContext | None, plain_types: tuple[type, ...]) -> bool:
    """Whether this forward can take the fused layers (else the modules run it). plain_types: the module classes the
    C++ op computes exactly; a layer holding anything else (a LoRA wrapper around a linear, a subclass) or any forward
    hook (a caller watching or changing a layer) runs through the modules."""
    if not (BUILT and ENABLED and step is not None and step.backend == "auto" and x.device.type == "cpu"):
        return False
    if model.tensor_parallel is not None or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return False
    if model.config.attention_bias or _global_hooks():
        return False
    for m in model.model.layers.modules():
        if type(m) not in plain_types or m._forward_hooks or m._forward_pre_hooks:
            return False
        if getattr(m, "expert_parallel", None) is not None:
            return False
    return model.model.norm.weight.dtype == x.dtype


def _global_hooks() -> bool:
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)


def run_layers(model, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, step: StepContext) -> torch.Tensor:
    """x [1, N, H] through every decoder layer, one C++ call each."""
    cfg = model.config
    cu = None if step.is_decode else step.cu_seqlens_q
    op = torch.ops.livemoe.decode_layer
    for layer in model.model.layers:
        attn = layer.self_attn
        k_cache, v_cache = step.kv_caches[attn.attn.layer_idx]
        top_k = layer.mlp.top_k if layer.mlp_is_moe else 0
        renorm = bool(layer.mlp.norm_topk_prob) if layer.mlp_is_moe else False
        x = op(x, layer_weights(layer), k_cache, v_cache, step.slot_mapping, cu, step.context_lens,
               step.block_tables, cos, sin, attn.num_heads, attn.num_kv_heads, cfg.rms_norm_eps, attn.attn.scale,
               top_k, renorm)
    return x
