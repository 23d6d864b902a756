"""Every MoE Triton kernel compiles for sm_90 (H100/H200) at the block sizes the heuristic picks, on a
machine without a GPU: Triton lowers to PTX and its bundled ptxas assembles it, so a kernel that only the
interpreter accepts (or that needs more than 227 KiB of shared memory) fails here, not on the GPU.

Runs in a subprocess (tests/sm90.py says why)."""

import torch
from sm90 import check_compile_script, script_main

from kernels.moe.configs import heuristic_config

SMEM_LIMIT = 227 * 1024  # sm_90 per-block maximum


def compile_all() -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.moe import align_triton as at
    from kernels.moe import grouped_gemm as gg

    target = GPUTarget("cuda", 90, 32)
    failures = []

    def build(fn, sig, consts, name, **opts):
        try:
            kernel = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target, options=opts)
            if kernel.metadata.shared > SMEM_LIMIT:
                failures.append(f"{name}: {kernel.metadata.shared} bytes of shared memory")
        except Exception as e:  # noqa: BLE001  (report every kernel that does not compile)
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:800]}")

    def ptrs(dtype, *names):
        return {n: "*" + dtype for n in names}

    def ints(*names):
        return {n: "i32" for n in names}

    def consts(**kw):
        return {k: "constexpr" for k in kw}, kw

    # bf16: every tier of the heuristic (decode, 32-, 64-row blocks, the wide tile); fp32: the two ends
    for torch_dtype, dt, token_counts in ((torch.bfloat16, "bf16", (1, 512, 1024, 4096)), (torch.float32, "fp32", (1, 4096))):
        prec = "ieee" if dt == "fp32" else "tf32"
        for tokens in token_counts:
            cfg = heuristic_config(tokens, 128, 2048, 768, 8, torch_dtype)
            opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            tiles = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                         PRECISION=prec)
            name = f"{dt} T={tokens} {cfg}"
            cs, cv = consts(**tiles, SAVE_PREACT=True)
            build(gg.gate_up_swiglu_kernel, {**ptrs(dt, "x_ptr", "w_ptr", "act_ptr", "preact_ptr"),
                                             **ptrs("i32", "sorted_ids_ptr", "expert_ids_ptr"),
                                             **ints("num_pairs", "top_k", "H", "I", "num_pid_m", "stride_xm", "stride_xk",
                                                    "stride_we", "stride_wn", "stride_wk", "stride_am", "stride_pm"),
                                             **cs}, cv, f"gate_up_swiglu {name}", **opts)
            cs, cv = consts(**tiles, SCALE_ROWS=True)
            build(gg.gather_gemm_kernel, {**ptrs(dt, "a_ptr", "b_ptr", "out_ptr"), **ptrs("fp32", "scale_ptr"),
                                          **ptrs("i32", "sorted_ids_ptr", "expert_ids_ptr"),
                                          **ints("num_pairs", "a_div", "N", "K", "num_pid_m", "stride_am", "stride_ak",
                                                 "stride_be", "stride_bn", "stride_bk", "stride_om"),
                                          **cs}, cv, f"gather_gemm {name}", **opts)
            cs, cv = consts(**tiles)
            build(gg.down_backward_kernel, {**ptrs(dt, "dy_ptr", "w_ptr", "preact_ptr"), **ptrs("fp32", "topk_w_ptr"),
                                            **ptrs(dt, "dpre_ptr", "act_ptr"), **ptrs("fp32", "dw_part_ptr"),
                                            **ptrs("i32", "sorted_ids_ptr", "expert_ids_ptr"),
                                            **ints("num_pairs", "top_k", "H", "I", "num_pid_m", "stride_dym", "stride_dyk",
                                                   "stride_we", "stride_wh", "stride_wi", "stride_pm", "stride_am"),
                                            **cs}, cv, f"down_backward {name}", **opts)
            cs, cv = consts(BLOCK_M=cfg.grad_block_m, BLOCK_N=cfg.grad_block_n, BLOCK_K=cfg.grad_block_k, SCALE_A=True,
                            PRECISION=prec)
            build(gg.expert_grad_kernel, {**ptrs(dt, "a_ptr", "b_ptr"), **ptrs("fp32", "scale_ptr"), **ptrs(dt, "out_ptr"),
                                          **ptrs("i32", "sorted_ids_ptr", "seg_start_ptr", "counts_ptr"),
                                          **ints("a_div", "b_div", "M", "N", "stride_am", "stride_bm", "stride_oe",
                                                 "stride_om"),
                                          **cs}, cv, f"expert_grad {name}", **opts)
    for num_experts, n in ((128, 8), (128, 32768), (256, 32768)):
        e_pad = triton.next_power_of_2(num_experts)
        chunk = max(16, min(triton.next_power_of_2(n), 16384 // e_pad))
        single = n <= chunk
        warps = 8 if chunk * e_pad >= 8192 else 4
        cs, cv = consts(BLOCK_SIZE=16, CHUNK=chunk, E_PAD=e_pad, SINGLE=single, FILL=max(16, min(128, 8192 // e_pad)))
        build(at._align_scatter_kernel, {**ptrs("i64", "ids_ptr"),
                                         **ptrs("i32", "chunk_offsets_ptr", "chunk_totals_ptr", "sorted_ids_ptr",
                                                "expert_ids_ptr", "counts_ptr", "total_ptr"),
                                         **ints("num_pairs", "num_experts", "num_chunks", "num_positions"), **cs}, cv,
              f"align_scatter E={num_experts} n={n}", num_warps=warps)
        cs, cv = consts(CHUNK=chunk, E_PAD=e_pad)
        build(at._align_count_kernel, {**ptrs("i64", "ids_ptr"), **ptrs("i32", "chunk_counts_ptr"), **ints("num_pairs"),
                                       **cs}, cv, f"align_count E={num_experts}", num_warps=warps)
        cs, cv = consts(E_PAD=e_pad, EXPERTS=min(e_pad, 32), ROWS=64)
        build(at._align_scan_kernel, {**ptrs("i32", "chunk_counts_ptr", "chunk_offsets_ptr", "totals_ptr"),
                                      **ints("num_chunks"), **cs}, cv, f"align_scan E={num_experts}")
    return failures



def test_kernels_compile_for_sm90():
    check_compile_script(__file__)


if __name__ == "__main__":
    script_main(compile_all, "all MoE kernels")
