"""Paged-KV ops: Triton kernels (under TRITON_INTERPRET=1 on the CPU) and the PyTorch fast path against
the plain reference, and the reference itself against dense causal attention.

Tolerances: fp32 1e-4 (online softmax reorders the sums; dot in IEEE fp32), fp16 2e-2 (inputs and
outputs rounded to fp16, accumulation in fp32).
"""
import pytest
import torch
import torch.nn.functional as F

from livemoe.kernels.attention import (paged_attention_reference, paged_decode_attention, paged_decode_torch,
                               paged_prefill_attention, paged_prefill_torch, store_kvcache,
                               store_kvcache_reference)

TOL = {torch.float32: 1e-4, torch.float16: 2e-2}
# the Triton tests: compiled on a GPU where there is one, else under the interpreter (inputs made on the
# CPU either way, so both see the same numbers)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
triton_here = pytest.mark.triton  # skips where neither a GPU nor TRITON_INTERPRET=1 (set by conftest) is there


def dev(*tensors):
    return [t.to(DEVICE) for t in tensors]


def make_cache(num_blocks, block_size, hkv, d, dtype, gen):
    k = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    v = torch.randn(num_blocks, block_size, hkv, d, generator=gen).to(dtype)
    return k, v


def random_tables(context_lens, block_size, num_blocks, gen):
    """Disjoint, shuffled block tables, padded with -1 (never read past the context)."""
    need = [-(-c // block_size) for c in context_lens]
    perm = torch.randperm(num_blocks, generator=gen)
    assert sum(need) <= num_blocks
    table = torch.full((len(need), max(need)), -1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[at:at + n].int()
        at += n
    return table


def dense_causal(q, k, v, scale):
    """q [T, Hq, D], k/v [L, Hkv, D] with the T queries at the last T positions."""
    T, L = q.shape[0], k.shape[0]
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    mask = torch.ones(T, L, dtype=torch.bool).tril(L - T)
    return F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                          attn_mask=mask, scale=scale).transpose(0, 1)


def test_reference_equals_dense_attention():
    gen = torch.Generator().manual_seed(0)
    bs, hq, hkv, d = 4, 4, 2, 8
    kc, vc = make_cache(32, bs, hkv, d, torch.float32, gen)
    ctx = [13, 5, 9]
    qlen = [4, 1, 9]
    tables = random_tables(ctx, bs, 32, gen)
    q = torch.randn(sum(qlen), hq, d, generator=gen)
    cu = torch.tensor([0] + list(torch.tensor(qlen).cumsum(0)), dtype=torch.int32)
    out = paged_attention_reference(q, kc, vc, cu, torch.tensor(ctx), tables, 0.3)
    for s in range(3):
        blocks = tables[s, : -(-ctx[s] // bs)].long()
        k = kc[blocks].flatten(0, 1)[: ctx[s]]
        v = vc[blocks].flatten(0, 1)[: ctx[s]]
        exp = dense_causal(q[cu[s]:cu[s + 1]], k, v, 0.3)
        torch.testing.assert_close(out[cu[s]:cu[s + 1]], exp, atol=1e-5, rtol=1e-5)


@triton_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("hkv,d", [(2, 16), (3, 24)])
def test_store_kvcache_triton(dtype, hkv, d):
    gen = torch.Generator().manual_seed(1)
    N, bs, nb = 11, 16, 4
    k = torch.randn(N, hkv, 2 * d, generator=gen).to(dtype)[..., :d]  # non-contiguous rows
    v = torch.randn(N, hkv, d, generator=gen).to(dtype)
    slots = torch.randperm(nb * bs, generator=gen)[:N].int()
    slots[[2, 7]] = -1  # padded rows
    ref_k, ref_v = torch.zeros(nb, bs, hkv, d, dtype=dtype), torch.zeros(nb, bs, hkv, d, dtype=dtype)
    store_kvcache_reference(k, v, ref_k, ref_v, slots)
    out_k, out_v = dev(torch.zeros_like(ref_k), torch.zeros_like(ref_v))
    store_kvcache(*dev(k, v), out_k, out_v, *dev(slots), backend="triton")
    assert torch.equal(out_k.cpu(), ref_k) and torch.equal(out_v.cpu(), ref_v)
    written = (ref_k.flatten(0, 1).abs().sum((1, 2)) > 0).sum()
    assert written == N - 2


@triton_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bs,hq,hkv,d", [(16, 4, 4, 16), (16, 8, 2, 16), (32, 6, 1, 24)])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_paged_decode_triton(dtype, bs, hq, hkv, d, num_splits):
    gen = torch.Generator().manual_seed(2)
    nb = 40
    ctx = [1, bs, bs + 1, 5 * bs + 3, 7]  # single token, exact block, spanning many blocks
    kc, vc = make_cache(nb, bs, hkv, d, dtype, gen)
    tables = random_tables(ctx, bs, nb, gen)
    q = torch.randn(len(ctx), hq, d, generator=gen).to(dtype)
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    cu = torch.arange(len(ctx) + 1, dtype=torch.int32)
    ref = paged_attention_reference(q.float(), kc.float(), vc.float(), cu, ctx_t, tables, d ** -0.5)
    out = paged_decode_attention(*dev(q, kc, vc, tables, ctx_t), d ** -0.5, num_splits=num_splits, backend="triton")
    torch.testing.assert_close(out.cpu().float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@triton_here
def test_paged_decode_triton_padded_row_is_zero():
    gen = torch.Generator().manual_seed(3)
    kc, vc = make_cache(4, 16, 2, 16, torch.float32, gen)
    tables = torch.tensor([[0, 1], [-1, -1]], dtype=torch.int32)
    ctx = torch.tensor([20, 0], dtype=torch.int32)  # row 1: a CUDA-graph padding row
    q = torch.randn(2, 4, 16, generator=gen)
    for splits in (1, 2):
        out = paged_decode_attention(*dev(q, kc, vc, tables, ctx), 0.25, num_splits=splits, backend="triton").cpu()
        assert torch.isfinite(out).all() and out[1].abs().max() == 0


@triton_here
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bs,hq,hkv,d", [(16, 4, 2, 16), (32, 3, 3, 8)])
def test_paged_prefill_triton(dtype, bs, hq, hkv, d):
    gen = torch.Generator().manual_seed(4)
    nb = 48
    # (cached prefix, new tokens): plain prefill, chunk over a cached prefix, decode rows, a long chunk
    cached = [0, 2 * bs, 3 * bs + 5, 0, 9]
    new = [7, 20, 1, 70, 1]
    ctx = [c + n for c, n in zip(cached, new)]
    kc, vc = make_cache(nb, bs, hkv, d, dtype, gen)
    tables = random_tables(ctx, bs, nb, gen)
    q = torch.randn(sum(new), hq, d, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    ref = paged_attention_reference(q.float(), kc.float(), vc.float(), cu, ctx_t, tables, d ** -0.5)
    out = paged_prefill_attention(*dev(q, kc, vc, cu, ctx_t, tables), d ** -0.5, max(new), backend="triton")
    torch.testing.assert_close(out.cpu().float(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2)])
def test_decode_torch_fast_path(hq, hkv):
    gen = torch.Generator().manual_seed(5)
    bs, d, nb = 4, 8, 64
    ctx = [1, 4, 5, 33, 17]
    kc, vc = make_cache(nb, bs, hkv, d, torch.float32, gen)
    tables = random_tables(ctx, bs, nb, gen)
    q = torch.randn(len(ctx), hq, d, generator=gen)
    ctx_t = torch.tensor(ctx)
    ref = paged_attention_reference(q, kc, vc, torch.arange(len(ctx) + 1), ctx_t, tables, 0.3)
    torch.testing.assert_close(paged_decode_torch(q, kc, vc, tables, ctx_t, 0.3), ref, atol=1e-5, rtol=1e-5)


def test_store_then_attend_roundtrip():
    """Write K/V through store_kvcache, then prefill attention equals dense causal attention."""
    gen = torch.Generator().manual_seed(6)
    bs, hq, hkv, d, T = 16, 4, 2, 16, 37
    kc, vc = torch.zeros(8, bs, hkv, d), torch.zeros(8, bs, hkv, d)
    table = torch.tensor([[5, 2, 7]], dtype=torch.int32)
    pos = torch.arange(T)
    slots = (table[0, pos // bs] * bs + pos % bs).int()
    q, k, v = (torch.randn(T, h, d, generator=gen) for h in (hq, hkv, hkv))
    store_kvcache(k, v, kc, vc, slots, backend="triton")
    out = paged_prefill_attention(q, kc, vc, torch.tensor([0, T], dtype=torch.int32),
                                  torch.tensor([T], dtype=torch.int32), table, 0.25, T, backend="triton")
    torch.testing.assert_close(out, dense_causal(q, k, v, 0.25), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2)])
def test_prefill_torch_fast_path(hq, hkv):
    gen = torch.Generator().manual_seed(7)
    bs, d, nb = 4, 8, 64
    cached, new = [0, 9, 4, 0], [5, 3, 1, 12]
    ctx = [c + n for c, n in zip(cached, new)]
    kc, vc = make_cache(nb, bs, hkv, d, torch.float32, gen)
    tables = random_tables(ctx, bs, nb, gen)
    q = torch.randn(sum(new), hq, d, generator=gen)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist())
    args = (q, kc, vc, cu, torch.tensor(ctx), tables, 0.3)
    torch.testing.assert_close(paged_prefill_torch(*args), paged_attention_reference(*args), atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_triton_kernels_bf16_gpu(num_splits):
    """Real shapes (Qwen3-30B-A3B attention: 32/4 heads, d 128) in bf16; tolerance of bf16 rounding."""
    gen = torch.Generator(device="cuda").manual_seed(8)
    bs, hq, hkv, d, nb = 16, 32, 4, 128, 600
    ctx = [1, 17, 1000, 4000 // 16 * 16 + 5]
    kc = torch.randn(nb, bs, hkv, d, device="cuda", generator=gen).bfloat16()
    vc = torch.randn(nb, bs, hkv, d, device="cuda", generator=gen).bfloat16()
    tables = random_tables(ctx, bs, nb, torch.Generator().manual_seed(0)).cuda()
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    q = torch.randn(len(ctx), hq, d, device="cuda", generator=gen).bfloat16()
    cu = torch.arange(len(ctx) + 1, dtype=torch.int32, device="cuda")
    ref = paged_attention_reference(q.float(), kc.float(), vc.float(), cu, ctx_t, tables, d ** -0.5)
    out = paged_decode_attention(q, kc, vc, tables, ctx_t, d ** -0.5, num_splits=num_splits, backend="triton")
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)
    new = [1, 17, 300, 64]
    qp = torch.randn(sum(new), hq, d, device="cuda", generator=gen).bfloat16()
    cup = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    ref = paged_attention_reference(qp.float(), kc.float(), vc.float(), cup, ctx_t, tables, d ** -0.5)
    out = paged_prefill_attention(qp, kc, vc, cup, ctx_t, tables, d ** -0.5, max(new), backend="triton")
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.gpu
def test_flash_attn_prefill_gpu():
    pytest.importorskip("flash_attn", reason="needs flash-attn (GPU only)")
    gen = torch.Generator().manual_seed(9)
    bs, hq, hkv, d, nb = 256, 8, 2, 128, 12
    cached, new = [0, 300, 40], [50, 20, 1]
    ctx = [c + n for c, n in zip(cached, new)]
    kc, vc = (t.cuda() for t in make_cache(nb, bs, hkv, d, torch.bfloat16, gen))
    tables = random_tables(ctx, bs, nb, gen).cuda()
    tables[tables < 0] = 0
    q = torch.randn(sum(new), hq, d, generator=gen).bfloat16().cuda()
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    ctx_t = torch.tensor(ctx, dtype=torch.int32, device="cuda")
    ref = paged_attention_reference(q.float(), kc.float(), vc.float(), cu, ctx_t, tables, d ** -0.5)
    out = paged_prefill_attention(q, kc, vc, cu, ctx_t, tables, d ** -0.5, max(new), max_context_len=max(ctx))
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


def test_decode_splits_follow_the_devices_sm_count():
    """The split-KV count fills the device it runs on (its SM count is read, not assumed to be an H100's):
    fewer SMs, fewer splits for the same small batch; a batch that fills the SMs alone is not split."""
    from livemoe.kernels._ext import sm_count
    from livemoe.kernels.attention import choose_num_splits

    assert sm_count("cpu") == 1
    if torch.cuda.is_available():
        assert sm_count("cuda") == torch.cuda.get_device_properties(0).multi_processor_count
    many, few = (choose_num_splits(1, 8, 8192, 16, num_sms=n) for n in (132, 16))
    assert many == 16 and few == 4
    assert choose_num_splits(16, 8, 8192, 16, num_sms=64) == 1  # 128 programs already fill 64 SMs twice
    assert choose_num_splits(1, 8, 32, 16, num_sms=132) == 1  # 2 blocks of context: too little to split
