"""Triton: write the step's K/V into the paged cache by slot mapping (slot -1 skipped: padded rows)."""
import torch
import triton
import triton.language as tl


@triton.jit
def _store_kvcache_kernel(K, V, K_cache, V_cache, Slot_mapping,
                          stride_kn, stride_kh, stride_vn, stride_vh,
                          NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                          BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    row = tl.program_id(0)
    slot = tl.load(Slot_mapping + row).to(tl.int64)
    if slot < 0:
        return
    offs_h = tl.arange(0, BLOCK_H)[:, None]
    offs_d = tl.arange(0, BLOCK_D)[None, :]
    mask = (offs_h < NUM_KV_HEADS) & (offs_d < HEAD_DIM)
    k = tl.load(K + row * stride_kn + offs_h * stride_kh + offs_d, mask=mask)
    v = tl.load(V + row * stride_vn + offs_h * stride_vh + offs_d, mask=mask)
    # the cache is contiguous: a slot is NUM_KV_HEADS * HEAD_DIM consecutive elements
    dst = slot * (NUM_KV_HEADS * HEAD_DIM) + offs_h * HEAD_DIM + offs_d
    tl.store(K_cache + dst, k.to(K_cache.dtype.element_ty), mask=mask)
    tl.store(V_cache + dst, v.to(V_cache.dtype.element_ty), mask=mask)


def store_kvcache_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                         slot_mapping: torch.Tensor) -> None:
    """k/v [N, Hkv, D] (last dim contiguous), caches [num_blocks, block_size, Hkv, D] contiguous."""
    N, hkv, d = k.shape
    assert v.shape == k.shape and slot_mapping.shape == (N,), (k.shape, v.shape, slot_mapping.shape)
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "head_dim must be contiguous"
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.shape[2:] == (hkv, d)
    if N == 0:
        return
    _store_kvcache_kernel[(N,)](k, v, k_cache, v_cache, slot_mapping,
                                k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                                NUM_KV_HEADS=hkv, HEAD_DIM=d,
                                BLOCK_H=triton.next_power_of_2(hkv), BLOCK_D=triton.next_power_of_2(d))
