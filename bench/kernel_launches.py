"""Every Triton kernel launch the dispatch makes at Qwen3-30B-A3B's shapes, as data: the kernel, the values of
its arguments (tensors stand as their dtype) and its launch options, built from the same config functions
the host code calls (heuristic_config, launch_meta, align_meta, decode_meta, prefill_meta). bench/static_gpu.py
compiles them for sm_90a and reports their resources (livemoe/kernels/static_resources.py);
tests/integration/test_*_compile.py compile the same list, so what is tested is what runs.
"""
from dataclasses import dataclass

import torch
import triton

from livemoe.kernels.attention import choose_num_splits, decode, prefill
from livemoe.kernels.attention.store import _store_kvcache_kernel
from livemoe.kernels.logprobs import triton_logprobs as lp
from livemoe.kernels.moe.configs import heuristic_config
from livemoe.kernels.moe.launches import DT, align_launches, moe_launches
from livemoe.kernels.static_resources import Launch


@dataclass(frozen=True)
class Qwen3Shapes:
    """Qwen3-30B-A3B, and the token counts the report covers."""
    hidden: int = 2048
    moe_inter: int = 768
    experts: int = 128
    top_k: int = 8
    q_heads: int = 32
    kv_heads: int = 4
    head_dim: int = 128
    vocab: int = 151_936
    kv_block: int = 16  # EngineConfig.block_size
    moe_tokens: tuple = (1, 8, 64, 512, 4096)
    logprob_tokens: int = 8192
    decode_batches: tuple = (1, 64, 256)
    context: int = 4096
    prefill_tokens: int = 8192  # EngineConfig.max_num_batched_tokens
    num_sms: int = 132  # an H200's: the log-prob forward splits the vocabulary to fill them


def moe_qwen3_launches(s: Qwen3Shapes, dtype: torch.dtype) -> list[Launch]:
    """The MoE launches of every token count at the config the dispatch picks (configs.get_config falls back
    to heuristic_config on a GPU with no tuned entry, as on a first run). In fp32 (tests only: no spill
    rule) one token count per config suffices; in 16 bits every count, since the counts of one config
    still differ in the launch's divisibility hints (T k pairs, align blocks), each its own compile."""
    out, configs = [], set()
    for T in s.moe_tokens:
        cfg = heuristic_config(T, s.experts, s.hidden, s.moe_inter, s.top_k, dtype)
        if dtype == torch.float32 and cfg in configs:
            continue
        configs.add(cfg)
        out += moe_launches(cfg, T, s.hidden, s.moe_inter, s.experts, s.top_k, dtype)
        if dtype == torch.bfloat16:  # the align kernels take no model dtype: listed once
            out += align_launches(T * s.top_k, s.experts, cfg.block_m, f"T={T}")
    return out


def logprobs_launches(s: Qwen3Shapes, dtype: torch.dtype) -> list[Launch]:
    """triton_logprobs.forward and backward at N tokens with a completion mask (n_valid on the device)."""
    N, H, V = s.logprob_tokens, s.hidden, s.vocab
    blocks = lp.launch_meta(N, H, dtype)
    warps = blocks.pop("num_warps")
    block_n, block_v = blocks["BLOCK_N"], blocks["BLOCK_V"]
    v_tiles = triton.cdiv(V, block_v)
    splits = max(1, min(v_tiles, triton.cdiv(2 * s.num_sms, triton.cdiv(N, block_n))))
    vocab_per_split = triton.cdiv(v_tiles, splits) * block_v
    chunk_tokens = min(N, 1 << 15)  # api.py: TRITON_MAX_TOKENS, TRITON_DZ_BYTES
    chunk_vocab = max(128, (1 << 28) // (chunk_tokens * torch.finfo(dtype).bits // 8))
    chunk_vocab = max(block_v, chunk_vocab // block_v * block_v)
    f32, i32, i64 = torch.float32, torch.int32, torch.int64
    case = f"N={N} V={V} H={H} {DT[dtype]}"
    shape = dict(N=N, V=V, H=H)
    out = []
    for entropy in (False, True):
        out.append(Launch("logprobs", case + (" entropy" if entropy else ""), dtype, lp._logprobs_fwd_kernel, dict(
            h_ptr=dtype, w_ptr=dtype, tgt_ptr=i64, n_valid_ptr=i32, m_ptr=f32, l_ptr=f32, e_ptr=f32, t_ptr=f32,
            N=N, V=V, H=H, stride_h=H, stride_w=H, inv_temp=1.0, vocab_per_split=vocab_per_split,
            HAS_N_VALID=True, WITH_ENTROPY=entropy, **blocks), num_warps=warps, extra=shape))
        out.append(Launch("logprobs", case + (" entropy" if entropy else ""), dtype, lp._logprobs_bwd_dz_kernel, dict(
            h_ptr=dtype, w_ptr=dtype, tgt_ptr=i64, n_valid_ptr=i32, lse_ptr=f32, gl_ptr=f32, a_ptr=f32, b_ptr=f32,
            dz_ptr=dtype, row0=0, N=chunk_tokens, col0=0, V=min(V, chunk_vocab), H=H, stride_h=H, stride_w=H,
            stride_dz=min(V, chunk_vocab), inv_temp=1.0, HAS_N_VALID=True, WITH_B=entropy, **blocks),
            num_warps=warps, extra=shape))
    return out


def attention_launches(s: Qwen3Shapes, dtype: torch.dtype) -> list[Launch]:
    """store_kvcache, paged decode (+ the split merge) at each decode batch, and a full prefill chunk."""
    hq, hkv, d, bs = s.q_heads, s.kv_heads, s.head_dim, s.kv_block
    i32, f32 = torch.int32, torch.float32
    group = hq // hkv
    max_blocks = s.context // bs
    cache = dict(stride_kb=bs * hkv * d, stride_ks=hkv * d, stride_kh=d, stride_vb=bs * hkv * d, stride_vs=hkv * d,
                 stride_vh=d, stride_bt=max_blocks)
    out = [Launch("attention", DT[dtype], dtype, _store_kvcache_kernel, dict(
        K=dtype, V=dtype, K_cache=dtype, V_cache=dtype, Slot_mapping=torch.int64, stride_kn=hkv * d, stride_kh=d,
        stride_vn=hkv * d, stride_vh=d, NUM_KV_HEADS=hkv, HEAD_DIM=d, BLOCK_H=triton.next_power_of_2(hkv),
        BLOCK_D=triton.next_power_of_2(d)))]
    seen_splits = set()
    for batch in s.decode_batches:
        splits = choose_num_splits(batch, hkv, s.context, bs, s.num_sms)
        if splits in seen_splits:
            continue
        seen_splits.add(splits)
        part = (hq * splits * d, splits * d, d, hq * splits, splits) if splits > 1 else (0, 0, 0, 0, 0)
        case = f"batch={batch} splits={splits} {DT[dtype]}"
        shape = dict(batch=batch, context=s.context, hq=hq, hkv=hkv, d=d)
        out.append(Launch("attention", case, dtype, decode._paged_decode_kernel, dict(
            Q=dtype, K_cache=dtype, V_cache=dtype, Block_tables=i32, Context_lens=i32, Out=dtype, Part_out=f32,
            Part_lse=f32, scale=d ** -0.5, stride_qb=hq * d, stride_qh=d, **cache, stride_ob=hq * d, stride_oh=d,
            **dict(zip(("stride_pb", "stride_ph", "stride_ps", "stride_lb", "stride_lh"), part)),
            **decode.decode_meta(group, d, bs, splits, dtype)), extra=shape))
        if splits > 1:
            out.append(Launch("attention", case, dtype, decode._merge_splits_kernel, dict(
                Part_out=f32, Part_lse=f32, Out=dtype,
                **dict(zip(("stride_pb", "stride_ph", "stride_ps", "stride_lb", "stride_lh"), part)),
                stride_ob=hq * d, stride_oh=d, **decode.merge_meta(d, splits)), extra=shape))
    n = s.prefill_tokens
    out.append(Launch("attention", f"{n} new tokens {DT[dtype]}", dtype, prefill._paged_prefill_kernel, dict(
        Q=dtype, K_cache=dtype, V_cache=dtype, Cu_seqlens_q=i32, Context_lens=i32, Block_tables=i32, Out=dtype,
        scale=d ** -0.5, stride_qn=hq * d, stride_qh=d, **cache, stride_on=hq * d, stride_oh=d,
        **prefill.prefill_meta(group, d, bs, n, 64, dtype)), extra=dict(tokens=n, hq=hq, hkv=hkv, d=d)))
    return out


def all_launches(s: Qwen3Shapes = Qwen3Shapes(), families=("moe", "logprobs", "attention"),
                 dtypes=(torch.bfloat16, torch.float32)) -> list[Launch]:
    out = []
    for dtype in dtypes:
        out += moe_qwen3_launches(s, dtype) + logprobs_launches(s, dtype) + attention_launches(s, dtype)
    return [launch for launch in out if launch.family in families]
