"""Attention over already-projected q/k/v. The plain path here is causal SDPA over [B, T] batches
(training, reference); the decoder's paged path hooks in here too, so the model never sees a request."""
import torch
import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float, layer_idx: int):
        super().__init__()
        assert num_heads % num_kv_heads == 0, (num_heads, num_kv_heads)
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale
        self.layer_idx = layer_idx

    def forward(self, q, k, v, attention_mask=None):
        """q [B, T, Hq, D], k/v [B, T, Hkv, D] -> [B, T, Hq, D]. attention_mask [B, T]: 1 = real token."""
        return causal_attention(q, k, v, self.scale, attention_mask)


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
