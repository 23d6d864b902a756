"""Plain PyTorch references for the paged-KV ops (fp32 math, short and obviously right).

Cache layout (one layer): k_cache / v_cache [num_blocks, block_size, num_kv_heads, head_dim]; token at
position p of a sequence lives in block block_table[p // block_size], slot p % block_size, i.e. at
flat slot block_table[p // block_size] * block_size + p % block_size.
"""
import torch
import torch.nn.functional as F


def store_kvcache_reference(k, v, k_cache, v_cache, slot_mapping) -> None:
    """k/v [N, Hkv, D] written at flat slots slot_mapping [N]; slot -1 (a padded row) is skipped."""
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        slots, k, v = slots[keep], k[keep], v[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))


def gather_kv(cache, block_table, length: int):
    """The first `length` tokens of one sequence from the paged cache: [length, Hkv, D]."""
    block_size = cache.shape[1]
    n = -(-length // block_size)
    return cache[block_table[:n].long()].flatten(0, 1)[:length]


def paged_attention_reference(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale):
    """Causal attention of each sequence's new queries over its whole cached context.

    q [N, Hq, D] (the new tokens of all sequences, concatenated); cu_seqlens_q [S + 1]; context_lens [S]
    (cached tokens including the new ones); block_tables [S, max_blocks]. Query i of a sequence with
    q_len new tokens sits at position context_len - q_len + i and sees positions <= its own.
    Decode is the case q_len == 1. Returns [N, Hq, D] in q's dtype.
    """
    out = torch.empty_like(q)
    hq, hkv = q.shape[1], k_cache.shape[2]
    cu = cu_seqlens_q.tolist()
    for s, ctx in enumerate(context_lens.tolist()):
        q_s = q[cu[s]:cu[s + 1]].float()  # [T, Hq, D]
        T = q_s.shape[0]
        if T == 0:
            continue
        k = gather_kv(k_cache, block_tables[s], ctx).float().repeat_interleave(hq // hkv, dim=1)
        v = gather_kv(v_cache, block_tables[s], ctx).float().repeat_interleave(hq // hkv, dim=1)
        scores = torch.einsum("thd,khd->htk", q_s, k) * scale
        q_pos = torch.arange(ctx - T, ctx, device=q.device)
        mask = torch.arange(ctx, device=q.device)[None, :] <= q_pos[:, None]
        probs = scores.masked_fill(~mask, float("-inf")).softmax(-1)
        out[cu[s]:cu[s + 1]] = torch.einsum("htk,khd->thd", probs, v).to(q.dtype)
    return out


def decode_gather_index(block_tables, context_lens, block_size: int):
    """For the batched decode path: flat cache slots [B, L] of every context token (L = longest context,
    shorter rows padded with slot 0) and the validity mask [B, L]. The same for every layer of a step,
    so callers compute it once per step."""
    max_ctx = int(context_lens.max()) if context_lens.numel() else 0
    pos = torch.arange(max_ctx, device=block_tables.device)
    valid = pos[None, :] < context_lens[:, None]
    blocks = block_tables[:, pos // block_size].long().clamp(min=0)
    slots = torch.where(valid, blocks * block_size + pos % block_size, 0)
    return slots, valid


def paged_decode_torch(q, k_cache, v_cache, block_tables, context_lens, scale, gather=None):
    """Decode (one query per sequence) batched in PyTorch, the CPU's fast path: q [B, Hq, D] -> [B, Hq, D].

    Same math as the reference, vectorised over the batch by padding every context to the longest;
    `gather` is decode_gather_index(...) when the caller already has it.
    """
    B, hq, D = q.shape
    hkv = k_cache.shape[2]
    slots, valid = decode_gather_index(block_tables, context_lens, k_cache.shape[1]) if gather is None else gather
    k = k_cache.view(-1, hkv, D)[slots]  # [B, L, Hkv, D]
    v = v_cache.view(-1, hkv, D)[slots]
    qg = q.view(B, hkv, hq // hkv, D).float()  # the GQA group as query rows of one KV head
    out = F.scaled_dot_product_attention(
        qg, k.transpose(1, 2).float(), v.transpose(1, 2).float(), attn_mask=valid[:, None, None, :], scale=scale)
    out = out.reshape(B, hq, D).masked_fill((context_lens == 0)[:, None, None], 0.0)  # padded rows: 0, as Triton
    return out.to(q.dtype)


def paged_prefill_torch(q, k_cache, v_cache, cu_seqlens_q, context_lens, block_tables, scale):
    """The CPU's fast path for steps with prefill chunks: per sequence, SDPA over its gathered context
    (same math as paged_attention_reference, fused by SDPA instead of spelled out)."""
    out = torch.empty_like(q)
    cu = cu_seqlens_q.tolist()
    for s, ctx in enumerate(context_lens.tolist()):
        T = cu[s + 1] - cu[s]
        if T == 0:
            continue
        qs = q[cu[s]:cu[s + 1]].transpose(0, 1)  # [Hq, T, D]
        k = gather_kv(k_cache, block_tables[s], ctx).transpose(0, 1)  # [Hkv, L, D]
        v = gather_kv(v_cache, block_tables[s], ctx).transpose(0, 1)
        if T == ctx:
            o = F.scaled_dot_product_attention(qs, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            mask = torch.ones(T, ctx, dtype=torch.bool, device=q.device).tril(ctx - T)
            o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[cu[s]:cu[s + 1]] = o.transpose(0, 1)
    return out
