"""The decoder's CPU step in one C++ call (torch.ops.livemoe.decode_step, csrc/decode_layer.cpp).

A small model's decode step on the CPU costs more in Python module calls and per-op dispatch than in arithmetic. The
C++ op makes the step's calls (the embedding, the rotary cos / sin, then per layer the norms, the q/k/v/o linears,
q/k-norm + RoPE, the KV store, paged attention, the router and routed experts or the dense MLP, the residual adds,
and the final norm) from C++, to the same kernels in the same order, so its hidden states are bitwise those of
Qwen3ForCausalLM.forward_hidden (tested). It serves a paged step (decode or prefill) of a whole text model (no
tensor parallel, no expert parallel, plain positions) in inference on the CPU with the C++ attention backend; every
other forward takes the modules.

Gathering the weights and checking the modules walks ~25 attributes per layer; the runner keeps the result in a
PlanCache (context.py; its own, passed in the StepContext), reused while nothing it was read from changed: every module, weight
and attribute read is still the same object, and no hook was registered anywhere since (torch's hook handles count
up one global id).
"""
import operator
from dataclasses import dataclass

import torch
from torch.utils.hooks import RemovableHandle

from livemoe.engine.model.context import StepContext
from livemoe.kernels import _ext

BUILT = _ext.has_op("decode_step")
ENABLED = True  # tests turn it off to compare against the module path


@dataclass(slots=True)
class StepCall:
    """What decode_step takes from the model, gathered by plan()."""
    embed: torch.Tensor
    inv_freq: torch.Tensor
    final_norm: torch.Tensor
    weights: list[torch.Tensor]  # every layer's, layer after layer
    top_k: list[int]  # each layer's (0: a dense MLP)
    renormalize: bool  # the MoE layers' norm_topk_prob
    cache_index: list[int]  # each layer's index into StepContext.kv_caches
    num_heads: int
    num_kv_heads: int
    eps: float
    scale: float


class _Reads:
    """Records every (dict, key) a plan read and the object it found, so that a later step checks them all at once."""
    __slots__ = ("dicts", "keys", "found")

    def __init__(self):
        self.dicts: list[dict] = []
        self.keys: list[str] = []
        self.found: list[object] = []

    def get(self, d: dict, key: str):
        value = d.get(key)
        self.dicts.append(d)
        self.keys.append(key)
        self.found.append(value)
        return value

    def attr(self, obj, name: str):
        """obj.name, read from (and checked in) its instance dict."""
        return self.get(obj.__dict__, name)

    def unchanged(self) -> bool:
        return all(map(operator.is_, map(dict.get, self.dicts, self.keys), self.found))


def _plain(m, plain_types: tuple[type, ...]) -> bool:
    return type(m) in plain_types and not m._forward_hooks and not m._forward_pre_hooks


def layer_call(layer, plain_types: tuple[type, ...], r: _Reads) -> tuple[list[torch.Tensor], int, bool] | None:
    """(weights in the order csrc/decode_layer.cpp takes them, top_k (0: dense MLP), renormalize), or None where a
    module the op stands in for is not one of plain_types (a LoRA wrapper around a linear, a subclass), has a forward
    hook (a caller watching or changing it), a bias, or experts spread over ranks. Reads the modules' dicts directly,
    through r."""
    sub = layer._modules
    attn, mlp = r.get(sub, "self_attn"), r.get(sub, "mlp")
    a, m = attn._modules, mlp._modules
    norms = [r.get(sub, "input_layernorm"), r.get(a, "q_norm"), r.get(a, "k_norm"),
             r.get(sub, "post_attention_layernorm")]
    linears = [r.get(a, "q_proj"), r.get(a, "k_proj"), r.get(a, "v_proj"), r.get(a, "o_proj")]
    if r.attr(layer, "mlp_is_moe"):
        experts = r.get(m, "experts")
        if r.attr(experts, "expert_parallel") is not None or not _plain(experts, plain_types):
            return None
        linears.append(r.get(m, "gate"))
        tail = [r.get(experts._parameters, "gate_up_proj"), r.get(experts._parameters, "down_proj")]
        top_k, renormalize = r.attr(mlp, "top_k"), bool(r.attr(mlp, "norm_topk_prob"))
    else:
        linears += [r.get(m, "gate_proj"), r.get(m, "up_proj"), r.get(m, "down_proj")]
        tail, top_k, renormalize = [], 0, False
    for mod in (layer, attn, mlp, r.get(a, "attn"), *norms, *linears):
        if not _plain(mod, plain_types):
            return None
    for lin in linears:
        if r.get(lin._parameters, "bias") is not None:
            return None
    w = [r.get(mod._parameters, "weight") for mod in linears]
    n = [r.get(mod._parameters, "weight") for mod in norms]
    return [n[0], w[0], w[1], w[2], w[3], n[1], n[2], n[3], *w[4:], *tail], top_k, renormalize


def plan(model, input_ids: torch.Tensor, step: StepContext | None, plain_types: tuple[type, ...]) -> StepCall | None:
    """The StepCall where this forward can take the fused step, else None (the modules run it). plain_types: the
    module types decode_step computes exactly. A step with a plan_cache reuses (and keeps) the plan there."""
    if not (BUILT and ENABLED and step is not None and step.backend == "auto" and input_ids.device.type == "cpu"):
        return None
    if model.tensor_parallel is not None or torch.is_grad_enabled() or torch.is_autocast_enabled("cpu"):
        return None
    cache = step.plan_cache
    if (cache is not None and cache.model is model and cache.hook_id == RemovableHandle.next_id
            and cache.reads.unchanged()):
        return cache.call
    hook_id = RemovableHandle.next_id
    r = _Reads()
    call = _gather(model, plain_types, r)
    if cache is not None and call is not None:
        cache.model, cache.call, cache.reads, cache.hook_id = model, call, r, hook_id
    return call


def _gather(model, plain_types: tuple[type, ...], r: _Reads) -> StepCall | None:
    inner = model.model._modules
    embed, norm, rotary = r.get(inner, "embed_tokens"), r.get(inner, "norm"), r.get(inner, "rotary_emb")
    if _global_hooks() or not all(_plain(m, plain_types) for m in (r.get(model._modules, "model"), embed, norm, rotary)):
        return None
    embed_w, norm_w = r.get(embed._parameters, "weight"), r.get(norm._parameters, "weight")
    # max_norm rewrites the embedding's weight; the final norm in another dtype would cast
    if r.attr(embed, "max_norm") is not None or norm_w.dtype != embed_w.dtype:
        return None
    layers = r.get(inner, "layers")
    weights, top_ks, renorm, cache_index = [], [], set(), []
    for key in list(layers._modules):
        layer = r.get(layers._modules, key)
        call = layer_call(layer, plain_types, r)
        if call is None:
            return None
        weights += call[0]
        top_ks.append(call[1])
        if call[1]:
            renorm.add(call[2])
        cache_index.append(layer._modules["self_attn"]._modules["attn"].layer_idx)
    r.get(layers._modules, str(len(top_ks)))  # None: a layer appended later changes it
    if len(renorm) > 1 or not top_ks:  # one flag for every MoE layer
        return None
    attn = layers[0].self_attn
    return StepCall(embed_w, r.get(rotary._buffers, "inv_freq"), norm_w, weights, top_ks,
                    renorm.pop() if renorm else False, cache_index, r.attr(attn, "num_heads"),
                    r.attr(attn, "num_kv_heads"), r.attr(norm, "eps"), r.attr(attn._modules["attn"], "scale"))


def _global_hooks() -> bool:
    from torch.nn.modules import module

    return bool(module._global_forward_hooks or module._global_forward_pre_hooks)


def run_step(call: StepCall, input_ids: torch.Tensor, positions: torch.Tensor, step: StepContext) -> torch.Tensor:
    """input_ids and positions [1, N] -> the final hidden states [1, N, H] (after the last norm), in one call."""
    caches = step.kv_caches
    kv = [t for i in call.cache_index for t in caches[i]]
    return torch.ops.livemoe.decode_step(
        input_ids, positions, call.embed, call.inv_freq, call.final_norm, call.weights, kv, step.slot_mapping,
        None if step.is_decode else step.cu_seqlens_q, step.context_lens, step.block_tables, call.top_k,
        call.num_heads, call.num_kv_heads, call.eps, call.scale, call.renormalize)
