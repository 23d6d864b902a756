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
from livemoe.kernels import rejection_sampler as rs
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
    spec_rows: int = 64 * 5  # speculative verification: 64 sequences, 4 drafts + the bonus row each


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


def exact_launches(s: Qwen3Shapes, dtype: torch.dtype) -> list[Launch]:
    """The exact mode's kernels (livemoe/kernels/batch_invariant/*.py) at the model's shapes: tiles fixed by the
    dtype, so one compile serves every token count (M, n and the number of pairs are not specialised on, or
    only through divisibility hints that do not change the arithmetic)."""
    from livemoe.kernels.batch_invariant import attention as bi_attention
    from livemoe.kernels.batch_invariant import experts, linear, log_softmax, rms_norm, rope, route, silu_mul

    H, E, k, I, d = s.hidden, s.experts, s.top_k, s.moe_inter, s.head_dim
    hq, hkv, bs = s.q_heads, s.kv_heads, s.kv_block
    T = s.prefill_tokens
    i32, i64, f32 = torch.int32, torch.int64, torch.float32
    meta = linear.linear_meta(dtype)
    warps, stages = meta.pop("num_warps"), meta.pop("num_stages")
    out = []

    def add(fn, case, args, **launch):
        out.append(Launch("exact", f"{case} {DT[dtype]}", dtype, fn, args, **launch))

    for what, n, kdim, bias in (("qkv", (hq + 2 * hkv) * d, H, False), ("o_proj bias", H, hq * d, True),
                                ("lm_head", s.vocab, H, False)):
        add(linear.bi_linear_kernel, what, dict(x_ptr=dtype, w_ptr=dtype, b_ptr=dtype, out_ptr=dtype, M=T, N=n, K=kdim,
                                                stride_xm=kdim, stride_wn=kdim, stride_om=n, HAS_BIAS=bias, **meta),
            num_warps=warps, num_stages=stages)
    for D in (H, d):
        add(rms_norm.bi_rms_norm_kernel, f"D={D}", dict(x_ptr=dtype, w_ptr=dtype, out_ptr=dtype, D=D, stride_xm=D,
                                                        stride_om=D, eps=1e-6, BLOCK_D=rms_norm.rms_norm_meta(D)["BLOCK_D"]))
    add(silu_mul.bi_silu_mul_kernel, "", dict(g_ptr=dtype, u_ptr=dtype, out_ptr=dtype, n=T * I,
                                              BLOCK=silu_mul.BLOCK))
    if dtype == torch.bfloat16:  # fp32 tables and logits whatever the model's dtype: listed once
        add(rope.bi_rope_kernel, "", dict(pos_ptr=i64, inv_ptr=f32, cos_ptr=f32, sin_ptr=f32, HALF=d // 2,
                                          **rope.rope_meta(d // 2)))
        add(log_softmax.bi_log_softmax_kernel, f"V={s.vocab}", dict(
            x_ptr=f32, out_ptr=f32, V=s.vocab, stride_xm=s.vocab, stride_om=s.vocab,
            BLOCK_V=log_softmax.BLOCK_V), num_warps=8)
        for replay in (False, True):
            add(route.bi_route_kernel, "replay" if replay else "", dict(
                logits_ptr=f32, replay_ptr=i64, w_ptr=f32, ids_ptr=i64, E=E, TOP_K=k, stride_lm=E, REPLAY=replay,
                RENORMALIZE=True, **route.route_meta(E)))
    add(bi_attention.bi_attention_kernel, f"hq={hq} hkv={hkv} d={d}", dict(
        Q=dtype, K_cache=dtype, V_cache=dtype, Seq_of=i32, Cu_seqlens_q=i32, Context_lens=i32, Block_tables=i32,
        Out=dtype, scale=d ** -0.5, block_size=bs, stride_qn=hq * d, stride_qh=d, stride_ks=hkv * d, stride_kh=d,
        stride_vs=hkv * d, stride_vh=d, stride_bt=s.context // bs, stride_on=hq * d, stride_oh=d,
        **bi_attention.attention_meta(hq // hkv, d, dtype)))
    cfg = experts.exact_config(dtype)
    for launch in moe_launches(cfg, T, H, I, E, k, dtype, backward=False):
        args = {**launch.args, "scale_ptr": dtype, "SCALE_ROWS": False} if "SCALE_ROWS" in launch.args else launch.args
        add(launch.fn, f"experts {launch.case.split(' ', 2)[-1]}", args, num_warps=cfg.num_warps,
            num_stages=cfg.num_stages)
    add(experts.bi_combine_kernel, f"k={k}", dict(y_ptr=dtype, w_ptr=f32, out_ptr=dtype, num_tokens=T, H=H, TOP_K=k,
                                                  BLOCK_H=experts.BLOCK_H))
    return out


def rejection_launches(s: Qwen3Shapes) -> list[Launch]:
    """The rejection sampler (fp32 probabilities whatever the model's dtype) with draft probabilities (draft_model)
    and with point masses (ngram), as rejection_sample_triton launches them."""
    f32, i64, V = torch.float32, torch.int64, s.vocab
    block = min(rs.BLOCK_V, triton.next_power_of_2(V))
    out = []
    for has_q in (True, False):
        case = f"rows={s.spec_rows} V={V} " + ("draft probs" if has_q else "point masses")
        out.append(Launch("rejection", case, f32, rs.residual_race_kernel, dict(
            P=f32, Q=f32, Noise=f32, Draft_ids=i64, Is_bonus=torch.int8, Recovered=i64, V=V, stride_p=V,
            stride_q=V, stride_n=V, HAS_Q=has_q, BLOCK_V=block)))
        out.append(Launch("rejection", case, f32, rs.accept_kernel, dict(
            P=f32, Q=f32, Draft_ids=i64, Uniforms=f32, Recovered=i64, Cu_rows=torch.int32, Tokens=i64,
            Num_emitted=torch.int32, stride_p=V, stride_q=V, stride_t=5, HAS_Q=has_q)))
    return out


def all_launches(s: Qwen3Shapes = Qwen3Shapes(), families=("moe", "logprobs", "attention", "exact", "rejection"),
                 dtypes=(torch.bfloat16, torch.float32)) -> list[Launch]:
    out = rejection_launches(s)  # fp32 whatever the model's dtype: listed once
    for dtype in dtypes:
        out += moe_qwen3_launches(s, dtype) + logprobs_launches(s, dtype) + attention_launches(s, dtype)
        if "exact" in families:
            out += exact_launches(s, dtype)
    return [launch for launch in out if launch.family in families]
