"""Attention over already-projected q/k/v. The plain path here is causal SDPA over [B, T] batches
(training, reference); the decoder's paged path hooks in here too, so the model never sees a request.

Paged path (the forward got the model runner's livemoe.engine.model.context.StepContext): the step's tokens come as one
flattened row, q [1, N, Hq, D]; their K/V are written into this layer's view of the runner's cache
(`step.kv_caches[layer_idx]`, [num_blocks, block_size, Hkv, D] each) at the step's slot_mapping, then
attention reads the whole context from the cache (decode kernel when every sequence has one new token,
prefill-over-cached-prefix kernel otherwise).
"""
import torch
import torch.nn.functional as F
from torch import nn

from livemoe.engine.model.context import StepContext
from livemoe.kernels import batch_invariant
from livemoe.kernels.batch_invariant import ops as exact_ops
from livemoe.kernels.attention import paged_decode_attention, paged_prefill_attention, store_kvcache


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int):
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_idx = layer_idx

    def forward(self, q, k, v, attention_mask=None, step: StepContext | None = None):
        """q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D]. attention_mask [B, T]: 1 = real token (causal); or
        [B, T, T]: True where query t sees key s (the whole pattern, causality included)."""
        if batch_invariant.enabled():
            return self.exact_forward(q, k, v, attention_mask, step)
        if step is None:
            return causal_attention(q, k, v, self.scale, attention_mask)
        return self.paged_forward(q, k, v, step)

    def exact_forward(self, q, k, v, attention_mask=None, step: StepContext | None = None):
        """The exact mode's attention (livemoe.kernels.batch_invariant): one per-query kernel, over the paged cache
        (decode and prefill alike) or over the batch's own K/V; gradients are causal_attention's."""
        if step is not None:
            k_cache, v_cache = step.kv_caches[self.layer_idx]
            store_kvcache(k[0], v[0], k_cache, v_cache, step.slot_mapping, step.backend)
            return exact_ops.paged_attention_forward(q[0], k_cache, v_cache, None if step.is_decode else step.cu_seqlens_q,
                                                     step.context_lens, step.block_tables, self.scale)[None]
        # right padding only: each real token then sees the real tokens before it, as in the decoder
        if attention_mask is not None and not bool((attention_mask.cumprod(-1) == attention_mask).all()):
            raise ValueError("exact (batch-invariant) attention takes right-padded batches only: attention_mask must "
                             "be ones, then zeros, on every row")
        return exact_ops.exact(lambda *t: exact_ops.causal_attention_forward(*t, self.scale),
                               lambda *t: causal_attention(*t, self.scale, attention_mask), q, k, v)

    def paged_forward(self, q, k, v, step: StepContext):
        assert q.shape[0] == 1, f"the paged path takes one flattened row of tokens, got batch {q.shape[0]}"
        k_cache, v_cache = step.kv_caches[self.layer_idx]
        q, k, v = q[0], k[0], v[0]
        store_kvcache(k, v, k_cache, v_cache, step.slot_mapping, step.backend)
        if step.is_decode:
            out = paged_decode_attention(q, k_cache, v_cache, step.block_tables, step.context_lens,
                                         self.scale, step.num_splits, step.backend, scratch=step.scratch)
        else:
            out = paged_prefill_attention(q, k_cache, v_cache, step.cu_seqlens_q, step.context_lens,
                                          step.block_tables, self.scale, step.max_seqlen_q, step.backend,
                                          step.max_context_len)
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
        if attention_mask.dim() == 3:  # [B, T, T]: which keys each query sees (e.g. K completions of one prompt)
            mask = attention_mask.bool()[:, None]
        else:
            causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
            mask = causal & attention_mask.bool()[:, None, None, :]
        # a padded query row would attend to nothing (NaN); let it see itself, its output is ignored
        mask = mask | torch.eye(T, dtype=torch.bool, device=q.device)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return out.transpose(1, 2)
