"""Paged attention ops against attention over contiguous K/V (what a decoder without a paged cache
runs: SDPA with the KV heads repeated for GQA), at the same shapes, in the same process.

Decode: one query per sequence over its context. CPU: our dispatch is the C++ op of
csrc/paged_attention.cpp (K/V read in place through the block tables), also recorded against the PyTorch
paged path it replaced (backend="reference": gather the context, SDPA); GPU: the Triton split-KV kernel in
bf16 at Qwen3-30B-A3B attention shapes (32 query heads, 4 KV heads, head_dim 128), with the memory floor
(reading the K/V once at the measured copy bandwidth). GPU rows carry the roofline model's time
(bench/roofline.py) for their measured / predicted column.
Prefill: a chunk of new tokens over a cached prefix (Triton on GPU, the C++ op on CPU; there also against
the PyTorch path: per-sequence SDPA over the gathered context).
"""
import pytest
import torch
import torch.nn.functional as F

from bench.common import measure, record
from bench.roofline import paged_decode as decode_cost
from bench.roofline import paged_prefill as prefill_cost
from bench.roofline import predict_s
from livemoe.kernels.attention import paged_decode_attention, paged_prefill_attention

SUITE = "attention"


pytestmark = pytest.mark.usefixtures("one_thread")

# (batch, context) per mode and device; heads (hq, hkv, d)
# CPU: (64, 50) is bench_decode's regime (the tiny model, 64 requests of contexts 9..80)
DECODE = {
    ("quick", "cpu"): [(8, 128), (64, 50)],
    ("full", "cpu"): [(64, 50), (1, 1024), (8, 1024), (32, 512)],
    ("quick", "cuda"): [(1, 4096), (64, 1024)],
    ("full", "cuda"): [(1, 1024), (1, 4096), (8, 1024), (8, 4096), (64, 1024), (64, 4096)],
}
HEADS = {"cpu": (4, 2, 16), "cuda": (32, 4, 128)}


def paged_inputs(batch, context, hq, hkv, d, block_size, dtype, device, q_len=1):
    g = torch.Generator(device=device).manual_seed(0)
    per_seq = -(-context // block_size)
    nb = batch * per_seq
    k_cache = torch.randn(nb, block_size, hkv, d, dtype=dtype, device=device, generator=g)
    v_cache = torch.randn(nb, block_size, hkv, d, dtype=dtype, device=device, generator=g)
    tables = torch.randperm(nb, device=device, generator=g).view(batch, per_seq).int()
    q = torch.randn(batch * q_len, hq, d, dtype=dtype, device=device, generator=g)
    ctx = torch.full((batch,), context, dtype=torch.int32, device=device)
    return q, k_cache, v_cache, tables, ctx


def contiguous_kv(cache, tables, context):
    """[B, Hkv, L, D]: the same K/V laid out per sequence."""
    return cache[tables.long()].flatten(1, 2)[:, :context].transpose(1, 2).contiguous()


def test_paged_decode(benchmark, bench_mode, device):
    hq, hkv, d = HEADS[device]
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    block_size = 16
    copy_gbps = None
    if device == "cuda":
        from bench.ceilings import measure_ceilings

        copy_gbps = measure_ceilings(device)["copy_GBps"]
    for i, (batch, context) in enumerate(DECODE[(bench_mode, device)]):
        q, kc, vc, tables, ctx = paged_inputs(batch, context, hq, hkv, d, block_size, dtype, device)
        scale = d ** -0.5

        def ours():
            return paged_decode_attention(q, kc, vc, tables, ctx, scale)

        k, v = contiguous_kv(kc, tables, context), contiguous_kv(vc, tables, context)

        def baseline():
            g = hq // hkv
            return F.scaled_dot_product_attention(q[:, :, None], k.repeat_interleave(g, 1),
                                                  v.repeat_interleave(g, 1), scale=scale)[:, :, 0]

        torch.testing.assert_close(ours().float(), baseline().float(), atol=2e-2, rtol=2e-2)
        if i == 0:
            benchmark.pedantic(ours, rounds=1, iterations=1)
        reps = 50 if device == "cuda" or batch * context <= 8192 else 5  # more for the short CPU calls (~30 us)
        t_ours = measure(ours, device, warmup=2, reps=reps)
        t_base = measure(baseline, device, warmup=2, reps=reps)
        floor = None
        if copy_gbps:
            kv_bytes = 2 * batch * context * hkv * d * dtype.itemsize
            floor = kv_bytes / (copy_gbps * 1e9) * 1e3
        case = f"decode b{batch} ctx{context} h{hq}/{hkv} d{d}"
        model = None
        if device == "cuda":
            model = 1e3 * predict_s(decode_cost(batch, context, hq, hkv, d, block_size, dtype.itemsize))
        record(suite=SUITE, case=case, metric="ms", ours=t_ours * 1e3, baseline=t_base * 1e3,
               baseline_name="SDPA on contiguous KV (GQA repeated)", floor=floor, model=model)
        if device == "cpu":
            t_ref = measure(lambda: paged_decode_attention(q, kc, vc, tables, ctx, scale, backend="reference"),
                            device, warmup=2, reps=reps)
            record(suite=SUITE, case=case, metric="ms", ours=t_ours * 1e3, baseline=t_ref * 1e3,
                   baseline_name="PyTorch paged path (gather + SDPA)")


# (batch, prefix, chunk); on the CPU the C++ op (bench_decode's prompts: 16-48 tokens over contexts up to 80,
# and a long chunk over a long prefix)
PREFILL = {
    ("quick", "cpu"): [(2, 64, 32)],
    ("full", "cpu"): [(8, 48, 32), (64, 0, 48), (4, 512, 256)],
    ("quick", "cuda"): [(4, 2048, 512)],
    ("full", "cuda"): [(8, 4096, 1024)],
}


def test_paged_prefill_over_cached_prefix(benchmark, bench_mode, device):
    hq, hkv, d = HEADS[device]
    for i, (batch, prefix, chunk) in enumerate(PREFILL[(bench_mode, device)]):
        context = prefix + chunk
        dtype = torch.bfloat16 if device == "cuda" else torch.float32
        q, kc, vc, tables, ctx = paged_inputs(batch, context, hq, hkv, d, 16, dtype, device, q_len=chunk)
        cu = torch.arange(0, (batch + 1) * chunk, chunk, dtype=torch.int32, device=device)
        scale = d ** -0.5

        def ours():
            return paged_prefill_attention(q, kc, vc, cu, ctx, tables, scale, chunk)

        k, v = contiguous_kv(kc, tables, context), contiguous_kv(vc, tables, context)
        mask = torch.ones(chunk, context, dtype=torch.bool, device=device).tril(prefix)

        def baseline():
            g = hq // hkv
            qb = q.view(batch, chunk, hq, d).transpose(1, 2)
            return F.scaled_dot_product_attention(qb, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1),
                                                  attn_mask=mask, scale=scale).transpose(1, 2).reshape(-1, hq, d)

        torch.testing.assert_close(ours().float(), baseline().float(), atol=2e-2, rtol=2e-2)
        if i == 0:
            benchmark.pedantic(ours, rounds=1, iterations=1)
        reps = 20 if device == "cuda" or batch * chunk * context <= 1 << 17 else 3
        t_ours = measure(ours, device, warmup=1, reps=reps)
        t_base = measure(baseline, device, warmup=1, reps=reps)
        case = f"prefill b{batch} prefix{prefix} chunk{chunk} h{hq}/{hkv} d{d}"
        model = None
        if device == "cuda":
            model = 1e3 * predict_s(prefill_cost(batch, prefix, chunk, hq, hkv, d, dtype.itemsize))
        record(suite=SUITE, case=case, metric="ms", ours=t_ours * 1e3, baseline=t_base * 1e3,
               baseline_name="SDPA on contiguous KV (GQA repeated)", model=model)
        if device == "cpu":
            t_ref = measure(lambda: paged_prefill_attention(q, kc, vc, cu, ctx, tables, scale, chunk, backend="reference"),
                            device, warmup=1, reps=reps)
            record(suite=SUITE, case=case, metric="ms", ours=t_ours * 1e3, baseline=t_ref * 1e3,
                   baseline_name="PyTorch paged path (gather + SDPA)")
