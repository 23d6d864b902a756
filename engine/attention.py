"""Attention over already-projected q/k/v. The plain path here is causal SDPA over [B, T] batches
(training, reference); the decoder's paged path hooks in here too, so the model never sees a request.

Paged path (an engine.context step context is set by the model runner): the step's tokens come as one
flattened row, q [1, N, Hq, D]; their K/V are written into this layer's `k_cache` / `v_cache`
([num_blocks, block_size, Hkv, D], assigned by the model runner) at the context's slot_mapping, then
attention reads the whole context from the cache (decode kernel when every sequence has one new
token, prefill-over-cached-prefix kernel otherwise).
"""
import torch
import torch.nn.functional as F
from torch import nn

from engine.context import get_context
from kernels.attention import paged_decode_attention, paged_prefill_attention, store_kvcache


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int):
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_idx = layer_idx
        self.k_cache: torch.Tensor | None = None  # set by the decoder's model runner (not state)
        self.v_cache: torch.Tensor | None = None

    def forward(self, q, k, v, attention_mask=None):
        """q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D]. attention_mask [B, T]: 1 = real token."""
        ctx = get_context()
        if ctx is None:
            return causal_attention(q, k, v, self.scale, attention_mask)
        return self.paged_forward(q, k, v, ctx)

    def paged_forward(self, q, k, v, ctx):
        assert q.shape[0] == 1, f"the paged path takes one flattened row of tokens, got batch {q.shape[0]}"
        assert self.k_cache is not None, f"layer {self.layer_idx}: no KV cache assigned"
        q, k, v = q[0], k[0], v[0]
        store_kvcache(k, v, self.k_cache, self.v_cache, ctx.slot_mapping, ctx.backend)
        if ctx.is_decode:
            out = paged_decode_attention(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.context_lens,
                                         self.scale, ctx.num_splits, ctx.backend, scratch=ctx.scratch)
        else:
            out = paged_prefill_attention(q, self.k_cache, self.v_cache, ctx.cu_seqlens_q, ctx.context_lens,
                                          ctx.block_tables, self.scale, ctx.max_seqlen_q, ctx.backend,
                                          ctx.max_context_len)
        return out.unsqueeze(0)


def causal_attention(q, k, v, scale, attention_mask=None):
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # [B, heads, T, D]
    group = q.shape[1] // k.shape[1]
    if group > 1:
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if attention_mask is None:
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
    else:
        T = q.shape[2]
        causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
        mask = causal & attention_mask.bool()[:, None, None, :]
        # a padded query row would attend to nothing (NaN); let it see itself, its output is ignored
        mask = mask | torch.eye(T, dtype=torch.bool, device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)
