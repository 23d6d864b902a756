"""The Triton log-prob kernels compile for an H100/H200 (sm_90) here, with no GPU: the interpreter
tests check their numbers but not what only the compiler rejects (non-constexpr globals, types,
shapes of tl.dot). Runs in a subprocess because TRITON_INTERPRET=1, set for this session, turns
@triton.jit functions into interpreted ones."""
import textwrap

import pytest
import torch
from sm90 import run_compiler

SCRIPT = textwrap.dedent('''
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from kernels.logprobs import triton_logprobs as k

    target = GPUTarget("cuda", 90, 32)
    blocks = {"BLOCK_N": 64, "BLOCK_V": 128, "BLOCK_K": 64}
    for dt, prec, flag in (("bf16", "tf32", True), ("fp32", "ieee", False)):
        common = {"h_ptr": f"*{dt}", "w_ptr": f"*{dt}", "tgt_ptr": "*i64", "n_valid_ptr": "*i32"}
        fwd = {**common, "m_ptr": "*fp32", "l_ptr": "*fp32", "e_ptr": "*fp32", "t_ptr": "*fp32", "N": "i32",
               "V": "i32", "H": "i32", "stride_h": "i32", "stride_w": "i32", "inv_temp": "fp32",
               "vocab_per_split": "i32"}
        consts = {"HAS_N_VALID": flag, "WITH_ENTROPY": flag, "INPUT_PRECISION": prec, **blocks}
        triton.compile(ASTSource(k._logprobs_fwd_kernel, {**fwd, **{c: "constexpr" for c in consts}}, consts),
                       target=target)
        bwd = {**common, "lse_ptr": "*fp32", "gl_ptr": "*fp32", "a_ptr": "*fp32", "b_ptr": "*fp32",
               "dz_ptr": f"*{dt}", "row0": "i32", "N": "i32", "col0": "i32", "V": "i32", "H": "i32",
               "stride_h": "i32", "stride_w": "i32", "stride_dz": "i32", "inv_temp": "fp32"}
        consts = {"HAS_N_VALID": flag, "WITH_B": flag, "INPUT_PRECISION": prec, **blocks}
        triton.compile(ASTSource(k._logprobs_bwd_dz_kernel, {**bwd, **{c: "constexpr" for c in consts}}, consts),
                       target=target)
    print("compiled")
''')


@pytest.mark.skipif(torch.cuda.is_available(), reason="the Triton tests compile and run these kernels on this machine")
def test_triton_kernels_compile_for_sm90():
    pytest.importorskip("triton")
    out = run_compiler(["-c", SCRIPT])
    assert out.returncode == 0 and "compiled" in out.stdout, out.stderr[-3000:]
