"""The paged attention Triton kernels compile for sm_90 (H100/H200) at Qwen3-30B-A3B's attention shape
(8 query heads per KV head, head_dim 128) on a machine without a GPU, in bf16 and fp32: a kernel that only
the interpreter accepts fails here, not on the GPU. Runs in a subprocess
(tests/sm90.py says why)."""

from sm90 import check_compile_script, script_main


def compile_all() -> list[str]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from kernels.attention import decode, prefill

    target = GPUTarget("cuda", 90, 32)
    failures = []

    def build(fn, ptr_dtypes, int_names, consts, name):
        sig = {**ptr_dtypes, **{n: "i32" for n in int_names}, "scale": "fp32", **{k: "constexpr" for k in consts}}
        try:
            triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts), target=target)
        except Exception as e:  # noqa: BLE001  (report every kernel that does not compile)
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:800]}")

    cache_strides = ["stride_kb", "stride_ks", "stride_kh", "stride_vb", "stride_vs", "stride_vh", "stride_bt"]
    for dt in ("bf16", "fp32"):
        for splits in (1, 4):
            build(decode._paged_decode_kernel,
                  {"Q": f"*{dt}", "K_cache": f"*{dt}", "V_cache": f"*{dt}", "Block_tables": "*i32",
                   "Context_lens": "*i32", "Out": f"*{dt}", "Part_out": "*fp32", "Part_lse": "*fp32"},
                  ["stride_qb", "stride_qh", *cache_strides, "stride_ob", "stride_oh", "stride_pb", "stride_ph",
                   "stride_ps", "stride_lb", "stride_lh"],
                  dict(GROUP=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_G=16, BLOCK_D=128, NUM_SPLITS=splits,
                       IEEE=dt == "fp32"), f"paged_decode {dt} splits={splits}")
        build(prefill._paged_prefill_kernel,
              {"Q": f"*{dt}", "K_cache": f"*{dt}", "V_cache": f"*{dt}", "Cu_seqlens_q": "*i32", "Context_lens": "*i32",
               "Block_tables": "*i32", "Out": f"*{dt}"},
              ["stride_qn", "stride_qh", *cache_strides, "stride_on", "stride_oh"],
              dict(GROUP=8, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_M=64, BLOCK_D=128, IEEE=dt == "fp32"),
              f"paged_prefill {dt}")
    return failures



def test_paged_attention_kernels_compile_for_sm90():
    check_compile_script(__file__)


if __name__ == "__main__":
    script_main(compile_all, "the paged attention kernels")
