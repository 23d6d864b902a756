"""The Triton launches of one MoE call, as data (livemoe/kernels/static_resources.py compiles them for sm_90a): what
experts_forward and TritonMoEFunction.backward (triton_moe.py) launch for a config and a shape, argument for
argument, and the align kernels of moe_align_triton. The tuner prunes its candidates with it; the static
report and the compile tests cover the configs the dispatch picks."""
import torch

from livemoe.kernels.dot_precision import dot_precision
from livemoe.kernels.moe import align_triton as at
from livemoe.kernels.moe import grouped_gemm as gg
from livemoe.kernels.moe.align_reference import num_align_blocks
from livemoe.kernels.moe.configs import MoEConfig
from livemoe.kernels.static_resources import Launch

DT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def moe_launches(cfg: MoEConfig, num_tokens: int, hidden: int, inter: int, num_experts: int, top_k: int,
                 dtype: torch.dtype, backward: bool = True) -> list[Launch]:
    """Forward (inference and training variants of gate_up_swiglu, then the down GEMM) and, with backward,
    down_backward, the dx GEMM and both weight gradients."""
    T, H, I, E, k = num_tokens, hidden, inter, num_experts, top_k
    i32, f32 = torch.int32, torch.float32
    P = T * k
    num_pid_m = num_align_blocks(P, E, cfg.block_m)
    tiles = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                 PRECISION=dot_precision(dtype))
    case = f"T={T} {DT[dtype]}"
    out = []

    def add(fn, what, args):
        out.append(Launch("moe", f"{case} {what}", dtype, fn, args, num_warps=cfg.num_warps,
                          num_stages=cfg.num_stages, extra=dict(T=T, H=H, I=I, E=E, k=k, op=what)))

    for save in (False, True) if backward else (False,):
        add(gg.gate_up_swiglu_kernel, "gate_up train" if save else "gate_up", dict(
            x_ptr=dtype, w_ptr=dtype, act_ptr=dtype, preact_ptr=dtype, sorted_ids_ptr=i32, expert_ids_ptr=i32,
            num_pairs=P, top_k=k, H=H, I=I, num_pid_m=num_pid_m, stride_xm=H, stride_xk=1, stride_we=2 * I * H,
            stride_wn=H, stride_wk=1, stride_am=I, stride_pm=2 * I if save else 0, SAVE_PREACT=save, **tiles))
    add(gg.gather_gemm_kernel, "down", dict(
        a_ptr=dtype, b_ptr=dtype, out_ptr=dtype, scale_ptr=f32, sorted_ids_ptr=i32, expert_ids_ptr=i32,
        num_pairs=P, a_div=1, N=H, K=I, num_pid_m=num_pid_m, stride_am=I, stride_ak=1, stride_be=H * I,
        stride_bn=I, stride_bk=1, stride_om=H, SCALE_ROWS=True, **tiles))
    if not backward:
        return out
    add(gg.down_backward_kernel, "down_backward", dict(
        dy_ptr=dtype, w_ptr=dtype, preact_ptr=dtype, topk_w_ptr=f32, dpre_ptr=dtype, act_ptr=dtype,
        dw_part_ptr=f32, sorted_ids_ptr=i32, expert_ids_ptr=i32, num_pairs=P, top_k=k, H=H, I=I,
        num_pid_m=num_pid_m, stride_dym=H, stride_dyk=1, stride_we=H * I, stride_wh=I, stride_wi=1,
        stride_pm=2 * I, stride_am=I, **tiles))
    add(gg.gather_gemm_kernel, "dx", dict(  # the scale slot gets a (SCALE_ROWS off)
        a_ptr=dtype, b_ptr=dtype, out_ptr=dtype, scale_ptr=dtype, sorted_ids_ptr=i32, expert_ids_ptr=i32,
        num_pairs=P, a_div=1, N=H, K=2 * I, num_pid_m=num_pid_m, stride_am=2 * I, stride_ak=1,
        stride_be=2 * I * H, stride_bn=1, stride_bk=H, stride_om=H, SCALE_ROWS=False, **tiles))
    grad_tiles = dict(BLOCK_M=cfg.grad_block_m, BLOCK_N=cfg.grad_block_n, BLOCK_K=cfg.grad_block_k,
                      PRECISION=dot_precision(dtype))
    add(gg.expert_grad_kernel, "dW_gate_up", dict(
        a_ptr=dtype, b_ptr=dtype, scale_ptr=dtype, out_ptr=dtype, sorted_ids_ptr=i32, seg_start_ptr=i32,
        counts_ptr=i32, a_div=1, b_div=k, M=2 * I, N=H, stride_am=2 * I, stride_bm=H, stride_oe=2 * I * H,
        stride_om=H, SCALE_A=False, **grad_tiles))
    add(gg.expert_grad_kernel, "dW_down", dict(
        a_ptr=dtype, b_ptr=dtype, scale_ptr=f32, out_ptr=dtype, sorted_ids_ptr=i32, seg_start_ptr=i32,
        counts_ptr=i32, a_div=k, b_div=1, M=H, N=I, stride_am=H, stride_bm=I, stride_oe=H * I, stride_om=I,
        SCALE_A=True, **grad_tiles))
    return out


def align_launches(num_pairs: int, num_experts: int, block_size: int, case: str) -> list[Launch]:
    """moe_align_triton's launches (align_triton.py); they carry no model dtype (int32 here)."""
    i32, i64 = torch.int32, torch.int64
    n = num_pairs
    meta = at.align_meta(n, num_experts)
    chunk, e_pad = meta["CHUNK"], meta["E_PAD"]
    num_chunks = max(1, -(-n // chunk))
    single = num_chunks == 1
    out = []
    if not single:
        out.append(Launch("moe", case, i32, at._align_count_kernel, dict(
            ids_ptr=i64, chunk_counts_ptr=i32, num_pairs=n, CHUNK=chunk, E_PAD=e_pad), num_warps=meta["num_warps"]))
        out.append(Launch("moe", case, i32, at._align_scan_kernel, dict(
            chunk_counts_ptr=i32, chunk_offsets_ptr=i32, totals_ptr=i32, num_chunks=num_chunks, E_PAD=e_pad,
            EXPERTS=meta["EXPERTS"], ROWS=meta["ROWS"])))
    out.append(Launch("moe", case, i32, at._align_scatter_kernel, dict(
        ids_ptr=i64, chunk_offsets_ptr=i32, chunk_totals_ptr=i32, sorted_ids_ptr=i32, expert_ids_ptr=i32,
        counts_ptr=i32, total_ptr=i32, num_pairs=n, num_experts=num_experts, num_chunks=num_chunks,
        num_positions=num_align_blocks(n, num_experts, block_size) * block_size, BLOCK_SIZE=block_size,
        CHUNK=chunk, E_PAD=e_pad, SINGLE=single, FILL=meta["FILL"]), num_warps=meta["num_warps"]))
    return out
