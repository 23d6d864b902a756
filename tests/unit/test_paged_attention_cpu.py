"""The C++ CPU paged-attention ops (csrc/paged_attention.cpp: torch.ops.livemoe.paged_attention and
store_kvcache) against the plain reference, and the CPU dispatch of livemoe.kernels.attention that uses them.

Two implementations of the op's kernels (csrc/attention_cpu.h): AVX2 + FMA, taken on an x86 CPU that has
them for head sizes that are a multiple of 8, and portable C++, taken elsewhere and for the other head sizes
(12 and 20 below), so both run here; ATEN_CPU_CAPABILITY=default makes every size take the portable ones
(test_portable_kernels_match_reference, in a fresh process).

Tolerances: fp32 2e-5 (the softmax runs per chunk of keys with a rescale between chunks, which reorders the
sums against the reference's one softmax; the queries are scaled before the dot products; the op's exp is a
polynomial with relative error ~1e-7; all accumulate in fp32); bf16 / fp16 caches: the reference reads the
same rounded K/V widened to fp32, so only the fp32 summation order differs (2e-5), and the output rounding to
q's 16-bit dtype (1e-2 for fp16, 2e-2 for bf16).
"""

import pytest
import torch

from fixtures import run_with_portable_kernels
from livemoe.kernels import _ext
from livemoe.kernels.attention import (paged_attention_reference, paged_decode_attention,
                               paged_prefill_attention, paged_prefill_torch, store_kvcache, store_kvcache_reference)

pytestmark = pytest.mark.skipif(not _ext.has_op("paged_attention"),
                                reason=f"the C++ extension is not built ({_ext.EXT_ERROR})")


def case(gen, bs, hq, hkv, d, new, cached, dtype=torch.float32, spare_blocks=3):
    """Random caches, disjoint shuffled block tables (-1 padded) and queries for sequences with
    `cached` tokens in cache before `new` new ones."""
    ctx = [c + n for c, n in zip(cached, new)]
    need = [-(-c // bs) for c in ctx]
    nb = sum(need) + spare_blocks
    kc = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    vc = torch.randn(nb, bs, hkv, d, generator=gen).to(dtype)
    perm = torch.randperm(nb, generator=gen)
    tables = torch.full((len(ctx), max(max(need), 1)), -1, dtype=torch.int32)
    at = 0
    for i, n in enumerate(need):
        tables[i, :n] = perm[at:at + n].int()
        at += n
    q = torch.randn(sum(new), hq, d, generator=gen).to(dtype)
    cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), dtype=torch.int32)
    return q, kc, vc, cu, torch.tensor(ctx, dtype=torch.int32), tables


def reference(q, kc, vc, cu, ctx, tables, scale):
    return paged_attention_reference(q.float(), kc.float(), vc.float(), cu, ctx, tables, scale)


OUT_TOL = {torch.float32: 2e-5, torch.float16: 1e-2, torch.bfloat16: 2e-2}


@pytest.mark.parametrize("bs", [1, 4, 16, 32])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 2), (8, 2)])  # GQA groups of 1, 2, 3 (odd), 4 rows
# 16/32/64/128: compile-time sizes; 8, 24: run-time sizes (AVX2 on x86); 12, 20: the portable kernels
@pytest.mark.parametrize("d", [8, 12, 16, 20, 24, 32, 64, 128])
def test_decode_matches_reference(bs, hq, hkv, d):
    gen = torch.Generator().manual_seed(bs * 100 + hq * 10 + d)
    # one token, an exact block, just past a block, many blocks, a padded row (context 0)
    ctx = [1, bs, bs + 1, 9 * bs + 3, 0, 37]
    q, kc, vc, cu, ctx_t, tables = case(gen, bs, hq, hkv, d, [1] * len(ctx), [max(c - 1, 0) for c in ctx])
    ctx_t[4] = 0
    out = torch.ops.livemoe.paged_attention(q, kc, vc, None, ctx_t, tables, d ** -0.5)
    ref = reference(q, kc, vc, cu, ctx_t, tables, d ** -0.5)
    ref[4] = 0  # the reference runs its q_len-1 row over zero keys; the contract says output 0
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert out[4].abs().max() == 0
    # the same through cu_seqlens_q (what the engine passes) and through the dispatch
    torch.testing.assert_close(torch.ops.livemoe.paged_attention(q, kc, vc, cu, ctx_t, tables, d ** -0.5), out,
                               atol=0, rtol=0)
    torch.testing.assert_close(paged_decode_attention(q, kc, vc, tables, ctx_t, d ** -0.5), out, atol=0, rtol=0)


@pytest.mark.parametrize("bs", [4, 16])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 3), (8, 2), (3, 1)])
@pytest.mark.parametrize("d", [16, 20])  # AVX2 where there is AVX2 / portable
def test_prefill_matches_reference(bs, hq, hkv, d):
    gen = torch.Generator().manual_seed(bs + 7 * hq + d)
    # (cached prefix, new tokens): plain prefill, a chunk over a cached prefix, decode rows, a chunk longer than
    # the C++ query tile (16), a chunk ending mid-block, and a sequence with no new token this step
    cached = [0, 2 * bs, 3 * bs + 5, 0, 9, 5 * bs + 1, 4]
    new = [7, 20, 1, 70, 1, 33, 0]
    q, kc, vc, cu, ctx, tables = case(gen, bs, hq, hkv, d, new, cached)
    ref = reference(q, kc, vc, cu, ctx, tables, 0.3)
    out = torch.ops.livemoe.paged_attention(q, kc, vc, cu, ctx, tables, 0.3)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(paged_prefill_attention(q, kc, vc, cu, ctx, tables, 0.3, max(new)), out, atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("d", [64, 20])  # AVX2 where there is AVX2 / portable
def test_long_contexts_span_chunks(dtype, d):
    """Contexts of thousands of keys run in several chunks: the maximum found in a later chunk rescales what
    the earlier ones summed (one key per sequence is made the sharpest, late in its context)."""
    gen = torch.Generator().manual_seed(17 + d)
    bs, hq, hkv = 16, 8, 2
    cached, new = [2999, 1500, 4000, 700], [1, 1, 1, 24]  # decode rows and a prefill chunk
    q, kc, vc, cu, ctx, tables = case(gen, bs, hq, hkv, d, new, cached, dtype)
    for s, pos in enumerate([2900, 1499, 3100, 650]):  # key at pos of sequence s along its first query's head 0
        blk, slot = tables[s, pos // bs], pos % bs
        kc[blk, slot, 0] = (q[cu[s], 0].float() * 3).to(dtype)
    ref = reference(q.float(), kc, vc, cu, ctx, tables, d ** -0.5)
    out = torch.ops.livemoe.paged_attention(q.float(), kc, vc, cu, ctx, tables, d ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


def test_long_prefill_chunk_takes_the_cpp_op():
    """A long prompt chunk over a cached prefix goes to the C++ op too (faster than gather + SDPA at every size
    measured), and agrees with the PyTorch path."""
    gen = torch.Generator().manual_seed(15)
    hq, d = 4, 16
    new = [300, 3]
    q, kc, vc, cu, ctx, tables = case(gen, 16, hq, 2, d, new, [300, 7])
    out = paged_prefill_attention(q, kc, vc, cu, ctx, tables, 0.3, max(new))
    assert torch.equal(out, torch.ops.livemoe.paged_attention(q, kc, vc, cu, ctx, tables, 0.3))
    torch.testing.assert_close(out, paged_prefill_torch(q, kc, vc, cu, ctx, tables, 0.3), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(out, reference(q, kc, vc, cu, ctx, tables, 0.3), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_caches(dtype):
    gen = torch.Generator().manual_seed(11)
    bs, hq, hkv, d = 16, 8, 2, 32
    cached, new = [0, 40, 3, 100], [19, 1, 1, 17]
    q, kc, vc, cu, ctx, tables = case(gen, bs, hq, hkv, d, new, cached, dtype)
    out = torch.ops.livemoe.paged_attention(q, kc, vc, cu, ctx, tables, d ** -0.5)
    assert out.dtype == dtype
    ref = reference(q, kc, vc, cu, ctx, tables, d ** -0.5)
    torch.testing.assert_close(out.float(), ref, atol=OUT_TOL[dtype], rtol=OUT_TOL[dtype])
    # with fp32 queries over the 16-bit cache, only the summation order differs from the reference
    out32 = torch.ops.livemoe.paged_attention(q.float(), kc, vc, cu, ctx, tables, d ** -0.5)
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32, ref, atol=2e-5, rtol=2e-5)


def test_sharp_softmax():
    """Scores hundreds apart (the exp polynomial's clamp below -87, rescaling when a later block holds the max)."""
    gen = torch.Generator().manual_seed(16)
    q, kc, vc, cu, ctx, tables = case(gen, 4, 4, 2, 32, [1, 1, 5], [40, 3, 30])
    q = q * 40
    ref = reference(q, kc, vc, cu, ctx, tables, 32 ** -0.5)
    out = torch.ops.livemoe.paged_attention(q, kc, vc, cu, ctx, tables, 32 ** -0.5)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("d", [16, 20])  # AVX2 where there is AVX2 / portable
def test_many_threads_same_result(d):
    """The tasks (sequence, kv head, query tile) are independent: the thread count changes nothing, not even
    where it decides whether the kv heads are split over tasks (7 tasks: split for 2 threads, not for 1),
    over several chunks of keys (the 1200-key context)."""
    gen = torch.Generator().manual_seed(12)
    q, kc, vc, cu, ctx, tables = case(gen, 8, 8, 2, d, [30, 1, 1, 45], [0, 1200, 5, 12])
    n = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = torch.ops.livemoe.paged_attention(q, kc, vc, cu, ctx, tables, 0.25)
        torch.set_num_threads(2)
        two = torch.ops.livemoe.paged_attention(q, kc, vc, cu, ctx, tables, 0.25)
    finally:
        torch.set_num_threads(n)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kvcache_matches_reference(dtype):
    gen = torch.Generator().manual_seed(13)
    N, bs, nb, hkv, d = 11, 4, 6, 3, 8
    k = torch.randn(N, hkv, 2 * d, generator=gen)[..., :d]  # non-contiguous rows, fp32 into any cache dtype
    v = torch.randn(N, hkv, d, generator=gen)
    slots = torch.randperm(nb * bs, generator=gen)[:N]
    slots[[2, 7]] = -1  # padded rows
    ref_k, ref_v = torch.zeros(nb, bs, hkv, d, dtype=dtype), torch.zeros(nb, bs, hkv, d, dtype=dtype)
    store_kvcache_reference(k, v, ref_k, ref_v, slots)
    out_k, out_v = torch.zeros_like(ref_k), torch.zeros_like(ref_v)
    torch.ops.livemoe.store_kvcache(k, v, out_k, out_v, slots)
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
    out_k.zero_(), out_v.zero_()
    store_kvcache(k, v, out_k, out_v, slots.int())  # the CPU dispatch
    assert torch.equal(out_k, ref_k) and torch.equal(out_v, ref_v)
    assert (ref_k.flatten(0, 1).abs().sum((1, 2)) > 0).sum() == N - 2


def test_bad_input_names_the_problem():
    gen = torch.Generator().manual_seed(14)
    q, kc, vc, cu, ctx, tables = case(gen, 4, 4, 2, 8, [3, 1], [5, 2])
    op = torch.ops.livemoe.paged_attention
    with pytest.raises(RuntimeError, match="outside"):
        bad = tables.clone()
        bad[0, 1] = kc.shape[0]
        op(q, kc, vc, cu, ctx, bad, 0.3)
    with pytest.raises(RuntimeError, match="multiple of Hkv"):
        op(q[:, :3], kc, vc, cu, ctx, tables, 0.3)
    with pytest.raises(RuntimeError, match="new tokens but context_len"):
        op(q, kc, vc, cu, torch.tensor([2, 3], dtype=torch.int32), tables, 0.3)
    with pytest.raises(RuntimeError, match="must match k_cache"):
        op(q, kc, vc[:-1], cu, ctx, tables, 0.3)
    with pytest.raises(RuntimeError, match="outside"):
        torch.ops.livemoe.store_kvcache(q[:, :2], q[:, :2], kc, vc, torch.tensor([0, 1, 999, 2]))


def test_portable_kernels_match_reference():
    """The portable kernels (see run_with_portable_kernels) at the head sizes AVX2 takes otherwise, decode and
    prefill, fp32 and bf16 caches."""
    code = (
        "import torch, tests.unit.test_paged_attention_cpu as t\n"
        "for d in (16, 64):\n"
        "    for dt in (torch.float32, torch.bfloat16):\n"
        "        gen = torch.Generator().manual_seed(d)\n"
        "        q, kc, vc, cu, ctx, tables = t.case(gen, 16, 8, 2, d, [1, 1, 19, 1], [0, 40, 30, 700], dt)\n"
        "        q = q.float()\n"
        "        out = torch.ops.livemoe.paged_attention(q, kc, vc, cu, ctx, tables, d ** -0.5)\n"
        "        torch.testing.assert_close(out, t.reference(q, kc, vc, cu, ctx, tables, d ** -0.5), atol=2e-5, rtol=2e-5)\n"
        "print('ok')\n")
    run_with_portable_kernels(code)
