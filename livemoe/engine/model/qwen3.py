"""Qwen3 (dense) and Qwen3-MoE as one nn.Module, shared by the trainers and the decoder.

State-dict keys are the hub's (model.layers.{i}.self_attn.q_proj.weight, ...), with MoE experts in
transformers-v5's fused layout (mlp.experts.gate_up_proj / down_proj); livemoe.engine.model.loader maps the hub's
per-expert layout onto it. Built with a livemoe.train.parallel.TensorParallel, the module is one rank's shard of
the model (livemoe.engine.model.tensor_parallel): the same keys over smaller tensors, the same forward, whose
collectives leave every rank with the same hidden states and full-vocab logits.
"""
import contextlib
import functools

import torch
from torch import nn

from livemoe.engine.model import fused_decode
from livemoe.engine.model.attention import Attention
from livemoe.engine.model.config import ModelConfig
from livemoe.engine.model.context import StepContext
from livemoe.engine.model.layers import MLP, Experts, RMSNorm, RotaryEmbedding, SparseMoeBlock, qk_norm_rotary
from livemoe.engine.model.linear import Linear, linear
from livemoe.engine.model.moe_loss import load_balancing_loss
from livemoe.engine.model.tensor_parallel import (ParallelLMHead, TensorParallel, VocabParallelEmbedding, column_linear,
                                                  gather_logits, row_linear)
from livemoe.kernels import batch_invariant
from livemoe.kernels.moe.routing import check_replay


def checkpoint_contexts(exact: str | None):
    """torch.utils.checkpoint's context_fn: nothing around the forward, the forward's kernel choice (the exact
    mode's backend, or None) around the recompute (the backward runs outside the caller's batch_invariant_mode)."""
    return contextlib.nullcontext(), batch_invariant.batch_invariant_mode(exact is not None, exact or "auto")


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TensorParallel | None = None):
        super().__init__()
        heads, kv_heads, d, hidden = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        bias = cfg.attention_bias
        q_rows = kv_rows = None  # this rank's heads (None: all of them, one process)
        if tp is not None:
            q_rows, kv_rows = tp.split(heads, d), tp.kv_heads(kv_heads, heads, d)
            heads, kv_heads = q_rows.size // d, kv_rows.size // d
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, d
        self.q_proj = column_linear(hidden, heads * d, bias, tp, q_rows)
        self.k_proj = column_linear(hidden, kv_heads * d, bias, tp, kv_rows)
        self.v_proj = column_linear(hidden, kv_heads * d, bias, tp, kv_rows)
        self.o_proj = row_linear(cfg.num_attention_heads * d, hidden, bias, tp, q_rows)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)  # Qwen3: per-head RMSNorm on q and k
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5, layer_idx)

    def forward(self, x, cos, sin, attention_mask=None, step: StepContext | None = None):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(B, T, self.num_kv_heads, self.head_dim)
        q, k = qk_norm_rotary(q, k, self.q_norm, self.k_norm, cos, sin)
        out = self.attn(q, k, v, attention_mask, step)
        return self.o_proj(out.reshape(B, T, -1))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, tp: TensorParallel | None = None):
        super().__init__()
        self.self_attn = SelfAttention(cfg, layer_idx, tp)
        self.mlp_is_moe = cfg.is_moe_layer(layer_idx)
        if self.mlp_is_moe:
            self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                                      cfg.num_experts_per_tok, cfg.norm_topk_prob, tp)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, tp)
        self.layer_idx = layer_idx
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attention_mask=None, step: StepContext | None = None, topk_ids=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention_mask, step)
        out, router_logits = self.mlp(self.post_attention_layernorm(x), topk_ids)
        return x + out, router_logits


def add_rows(x: torch.Tensor, flat_index: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """x [B, T, H] with rows [n, H] added at flattened B*T positions flat_index [n] (out of place: autograd-safe)."""
    flat = x.reshape(-1, x.shape[-1]).index_add(0, flat_index, rows.to(x.dtype))
    return flat.view_as(x)


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.embed_tokens = (nn.Embedding(cfg.vocab_size, cfg.hidden_size) if tp is None
                             else VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp))
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = rotary_embedding(cfg)


# what livemoe.engine.model.fused_decode's C++ step computes exactly: a model made of only these, hook-free (our
# Linear, not a plain nn.Linear: the C++ layer takes the skinny GEMV where Linear does, and nn.Linear never does)
FUSABLE_MODULES = (Qwen3Model, nn.Embedding, RotaryEmbedding, nn.ModuleList, DecoderLayer, SelfAttention, Attention,
                   RMSNorm, Linear, MLP, SparseMoeBlock, Experts)


def rotary_embedding(cfg: ModelConfig) -> RotaryEmbedding:
    return RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.omni.mrope_section if cfg.omni is not None else None)


class Qwen3ForCausalLM(nn.Module):
    """`model(input_ids [B, T]) -> logits [B, T, V]`; `forward_hidden` gives the final hidden states
    (for fused losses) and, on request, each MoE layer's router logits. With `tp`: one rank's shard (config
    stays the whole model's; see the module doc)."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel | None = None):
        super().__init__()
        self.config = cfg
        self.tensor_parallel = tp
        self.model = Qwen3Model(cfg, tp)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = (Linear(cfg.hidden_size, cfg.vocab_size, bias=False) if tp is None
                            else ParallelLMHead(cfg.hidden_size, cfg.vocab_size, tp))
        self.gradient_checkpointing = False

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H]: the output projection (the embedding when tied), for fused log-prob kernels (a rank's
        [V/N padded, H] rows under tensor parallel)."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def init_nonpersistent_buffers(self, device) -> None:
        """Rebuilds the buffers a checkpoint does not hold (a model made on the meta device has none)."""
        self.model.rotary_emb = rotary_embedding(self.config).to(device)

    def forward_hidden(self, input_ids, positions=None, attention_mask=None, return_router_logits=False,
                       step: StepContext | None = None, routed_experts: torch.Tensor | None = None,
                       inputs_embeds: torch.Tensor | None = None, deepstack=None):
        """input_ids [B, T] -> final hidden states [B, T, H] (after the last norm); with
        return_router_logits, also a tuple of router logits [B*T, E], one per MoE layer. `step`: the decoder's
        step (livemoe.engine.model.context; input_ids then one flattened row [1, N]); None is the plain causal forward.
        routed_experts [B, T, L, k] (L = the MoE layers, in order): routing replay (R3), each MoE layer runs
        these experts with weights from its own router logits (livemoe.kernels.moe.routing).
        Multimodal (the Omni thinker): positions [3, B, T] (time, height, width; see RotaryEmbedding),
        inputs_embeds [B, T, H] in place of the token embeddings (media spliced in), and deepstack
        (flat_index [n], [embeds [n, H], ...]): added to the hidden states at those flattened B*T rows after layers
        0, 1, ... (the vision encoder's intermediate features)."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        replay = self._replay_ids(input_ids, routed_experts)
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        call = None if replay is not None or deepstack is not None or return_router_logits or inputs_embeds is not None \
            or positions.dim() != 2 or batch_invariant.enabled() else fused_decode.plan(self, input_ids, step,
                                                                                         FUSABLE_MODULES)
        if call is not None:
            assert step is not None  # plan() says so
            return fused_decode.run_step(call, input_ids, positions, step)
        x = self.model.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        router_logits = []
        # the recompute of a checkpointed layer takes the kernels its forward took (exact mode or not)
        recompute = functools.partial(checkpoint_contexts, batch_invariant.current())
        for layer in self.model.layers:
            ids = replay[len(router_logits)] if replay is not None and layer.mlp_is_moe else None
            if self.gradient_checkpointing and self.training:
                x, logits = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, attention_mask, step, ids,
                                                              use_reentrant=False, context_fn=recompute)
            else:
                x, logits = layer(x, cos, sin, attention_mask, step, ids)
            if logits is not None:
                router_logits.append(logits)
            if deepstack is not None and layer.layer_idx < len(deepstack[1]):
                x = add_rows(x, deepstack[0], deepstack[1][layer.layer_idx])
        hidden = self.model.norm(x)
        return (hidden, tuple(router_logits)) if return_router_logits else hidden

    @property
    def num_moe_layers(self) -> int:
        return sum(layer.mlp_is_moe for layer in self.model.layers)

    def _replay_ids(self, input_ids: torch.Tensor, routed_experts: torch.Tensor | None) -> list | None:
        """Per MoE layer, the replayed topk_ids [B*T, k]; ValueError naming what does not fit."""
        if routed_experts is None:
            return None
        cfg, L = self.config, self.num_moe_layers
        if L == 0:
            raise ValueError("routing replay: the model is dense (no MoE layer)")
        if self.tensor_parallel is not None:
            raise ValueError("routing replay runs in the trainer's forward, not on a tensor-parallel decoder shard")
        B, T = input_ids.shape
        want = (B, T, L, cfg.num_experts_per_tok)
        if tuple(routed_experts.shape) != want:
            raise ValueError(f"routed_experts must be [B, T, MoE layers, k] = {list(want)}, "
                             f"got {list(routed_experts.shape)}")
        ids = routed_experts.to(device=input_ids.device, dtype=torch.long).reshape(B * T, L, -1)
        check_replay(ids, None, cfg.num_experts_per_tok, cfg.num_experts)  # once per forward: one host sync
        return [ids[:, i] for i in range(L)]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[..., H] -> [..., V] (the full vocab on every rank under tensor parallel)."""
        logits = linear(hidden, self.lm_head_weight)  # F.linear, or the C++ GEMV for 16-bit weights at decode sizes
        tp = self.tensor_parallel
        return logits if tp is None else gather_logits(logits, tp, self.config.vocab_size)

    def forward(self, input_ids, positions=None, attention_mask=None):
        return self.compute_logits(self.forward_hidden(input_ids, positions, attention_mask))

    def load_balancing_loss(self, router_logits, attention_mask=None, mode: str = "global", group=None,
                            routed_experts: torch.Tensor | None = None):
        """Unscaled MoE load-balancing loss of `forward_hidden(..., return_router_logits=True)`'s logits;
        the trainer multiplies by its λ_aux (config.router_aux_loss_coef by default). `group`: the
        data-parallel ranks whose tokens it counts (see livemoe.engine.model.moe_loss). routed_experts
        [B, T, L, k]: the replayed routing (R3) the expert counts follow."""
        cfg = self.config
        selected = None
        if routed_experts is not None:
            B, T = routed_experts.shape[:2]
            flat = routed_experts.to(device=router_logits[0].device, dtype=torch.long).reshape(B * T, len(router_logits), -1)
            selected = [flat[:, i] for i in range(len(router_logits))]
        return load_balancing_loss(router_logits, cfg.num_experts, cfg.num_experts_per_tok, attention_mask, mode,
                                   group, selected)
