"""Qwen3 (dense) and Qwen3-MoE as one nn.Module, shared by the trainers and the decoder.

State-dict keys are the hub's (model.layers.{i}.self_attn.q_proj.weight, ...), with MoE experts in
transformers-v5's fused layout (mlp.experts.gate_up_proj / down_proj); engine.loader maps the hub's
per-expert layout onto it.
"""
import torch
from torch import nn

from engine.attention import Attention
from engine.config import ModelConfig
from engine.context import StepContext
from engine.layers import MLP, RMSNorm, RotaryEmbedding, SparseMoeBlock, qk_norm_rotary
from engine.moe_loss import load_balancing_loss


class SelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(cfg.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, cfg.hidden_size, bias=bias)
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
    def __init__(self, cfg: ModelConfig, layer_idx: int):
        super().__init__()
        self.self_attn = SelfAttention(cfg, layer_idx)
        if cfg.is_moe_layer(layer_idx):
            self.mlp = SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.moe_intermediate_size,
                                      cfg.num_experts_per_tok, cfg.norm_topk_prob)
        else:
            self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, cos, sin, attention_mask=None, step: StepContext | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, attention_mask, step)
        out, router_logits = self.mlp(self.post_attention_layernorm(x))
        return x + out, router_logits


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)


class Qwen3ForCausalLM(nn.Module):
    """`model(input_ids [B, T]) -> logits [B, T, V]`; `forward_hidden` gives the final hidden states
    (for fused losses) and, on request, each MoE layer's router logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.config = cfg
        self.model = Qwen3Model(cfg)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.gradient_checkpointing = False

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """[V, H]: the output projection (the embedding when tied), for fused log-prob kernels."""
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def forward_hidden(self, input_ids, positions=None, attention_mask=None, return_router_logits=False,
                       step: StepContext | None = None):
        """input_ids [B, T] -> final hidden states [B, T, H] (after the last norm); with
        return_router_logits, also a tuple of router logits [B*T, E], one per MoE layer. `step`: the decoder's
        step (engine.context; input_ids then one flattened row [1, N]); None is the plain causal forward."""
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [B, T], got shape {tuple(input_ids.shape)}")
        if positions is None:
            positions = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb(positions, x.dtype)
        router_logits = []
        for layer in self.model.layers:
            if self.gradient_checkpointing and self.training:
                x, logits = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, attention_mask, step,
                                                              use_reentrant=False)
            else:
                x, logits = layer(x, cos, sin, attention_mask, step)
            if logits is not None:
                router_logits.append(logits)
        hidden = self.model.norm(x)
        return (hidden, tuple(router_logits)) if return_router_logits else hidden

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden, self.lm_head_weight)

    def forward(self, input_ids, positions=None, attention_mask=None):
        return self.compute_logits(self.forward_hidden(input_ids, positions, attention_mask))

    def load_balancing_loss(self, router_logits, attention_mask=None, mode: str = "global", group=None):
        """Unscaled MoE load-balancing loss of `forward_hidden(..., return_router_logits=True)`'s logits;
        the trainer multiplies by its λ_aux (config.router_aux_loss_coef by default). `group`: the
        data-parallel ranks whose tokens it counts (see engine.moe_loss)."""
        cfg = self.config
        return load_balancing_loss(router_logits, cfg.num_experts, cfg.num_experts_per_tok, attention_mask, mode,
                                   group)
