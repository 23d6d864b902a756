"""The static resource report's machinery (livemoe/kernels/static_resources.py): occupancy and cuobjdump parsing on
hand-computed cases, the JIT's specialisation rules, and, compiled for sm_90a in a subprocess (tests/sm90.py
says why), one kernel's registers and stack bytes checked against ptxas's own account of the same PTX, and
the tuner's pruning of candidates that spill or overflow shared memory."""
import os
import re
import subprocess
import tempfile

import pytest
import torch
from sm90 import check_compile_script, script_main

from livemoe.kernels.static_resources import occupancy, parse_res_usage, specialize


def test_occupancy_hand_computed():
    # 64 registers x 32 lanes = 2048 a warp: 32 warps by registers; 61 KiB + 1 KiB reserved: 3 blocks of 4 warps
    assert occupancy(64, 62464, 4) == (12, "shared memory")
    # 255 registers round up to 256 a lane, 8192 a warp: 8 warps, 2 blocks of 4
    assert occupancy(255, 1024, 4) == (8, "registers")
    # 128 registers, 8 warps a block: 16 warps fit by registers, 2 blocks
    assert occupancy(128, 0, 8) == (16, "registers")
    # 17 registers (24 after rounding to 256 a warp: 768), no shared memory: the 64-warp limit
    assert occupancy(17, 0, 4) == (64, "warps")


def test_parse_res_usage_reads_the_kernel_line():
    text = """
Resource usage:
 Common:
  GLOBAL:0
 Function gate_up_swiglu_kernel:
  REG:255 STACK:128 SHARED:1024 LOCAL:0 CONSTANT[0]:640 TEXTURE:0 SURFACE:0 SAMPLER:0
"""
    got = parse_res_usage(text)
    assert (got["REG"], got["STACK"], got["SHARED"], got["LOCAL"]) == (255, 128, 1024, 0)


def check_specialize() -> list[str]:
    """The JIT's specialisation rules (in the subprocess: under the interpreter triton.jit gives no params)."""
    import triton
    import triton.language as tl

    @triton.jit
    def k(x_ptr, n, stride, one, scale, BLOCK: tl.constexpr):
        pass

    args = dict(x_ptr=torch.bfloat16, n=7, stride=2048, one=1, scale=0.5, BLOCK=64)
    got = specialize(k, args)
    want = ({"x_ptr": "*bf16", "n": "i32", "stride": "i32", "one": "constexpr", "scale": "fp32", "BLOCK": "constexpr"},
            {(3,): 1, (5,): 64}, {(0,): [["tt.divisibility", 16]], (2,): [["tt.divisibility", 16]]})
    problems = [] if got == want else [f"specialize gave {got}, want {want}"]
    bare_sig, bare_consts, bare_attrs = specialize(k, args, hints=False)
    if bare_sig["one"] != "i32" or bare_consts != {(5,): 64} or bare_attrs != {}:
        problems.append(f"bare specialisation {bare_sig} {bare_consts} {bare_attrs}")
    try:
        specialize(k, {**args, "extra": 1})
        problems.append("an argument the kernel does not take was accepted")
    except AssertionError:
        pass
    return problems


def compile_checks() -> list[str]:
    """Run in the subprocess: the report's figures for the decode tier's gate_up_swiglu against ptxas -v on
    its PTX (ptxas, not cuobjdump, says how many registers it allocated and how big the stack frame is),
    and the pruning of three candidate configs."""
    import triton

    from bench.kernel_launches import all_launches
    from livemoe.kernels.moe.configs import MoEConfig, heuristic_config
    from livemoe.kernels.moe.tune import prune_candidates
    from livemoe.kernels.static_resources import compile_sm90, measure_launch

    problems = check_specialize()
    launch = next(l for l in all_launches(families=("moe",), dtypes=(torch.bfloat16,))
                  if l.kernel == "gate_up_swiglu_kernel" and l.case.startswith("T=1 "))
    row = measure_launch(launch)
    ptx = compile_sm90(launch).asm["ptx"]
    try:  # the ptxas triton itself runs for sm_90 (its newer one, where it ships two)
        from triton.backends.nvidia.compiler import get_ptxas

        ptxas = get_ptxas(90).path
    except (ImportError, TypeError, AttributeError):
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.TemporaryDirectory() as d:
        src = os.path.join(d, "k.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        log = subprocess.run([ptxas, "-lineinfo", "-v", "--regAllocOptLevel=2", "--gpu-name=sm_90a", src, "-o",
                              os.path.join(d, "k.cubin")], capture_output=True, text=True, check=True).stderr
    regs = int(re.search(r"Used (\d+) registers", log).group(1))
    stack = int(re.search(r"(\d+) bytes stack frame", log).group(1))
    print(f"report: {row.registers} registers, {row.stack_bytes} stack; ptxas -v: {regs}, {stack}")
    if (row.registers, row.stack_bytes) != (regs, stack):
        problems.append(f"report {row.registers} registers / {row.stack_bytes} stack, ptxas -v {regs} / {stack}")
    if row.occupancy_warps <= 0 or row.shared_bytes <= 0:
        problems.append(f"no occupancy or shared memory in {row}")

    fit = heuristic_config(1, 128, 2048, 768, 8, torch.bfloat16)
    too_much_smem = MoEConfig(128, 128, 128, group_m=8, num_warps=4, num_stages=4)  # 4 x 96 KiB of tiles
    spills = MoEConfig(128, 128, 64, group_m=8, num_warps=4, num_stages=3)  # two 128x128 fp32 accumulators
    kept, dropped = prune_candidates([fit, too_much_smem, spills], 1, 2048, 768, 128, 8, torch.bfloat16,
                                     backward=False)
    print("kept", kept, "dropped", dropped)
    if kept != [fit]:
        problems.append(f"pruning kept {kept}")
    if not any("shared memory" in why for why in dropped.get(too_much_smem, [])):
        problems.append(f"{too_much_smem} not dropped for shared memory: {dropped.get(too_much_smem)}")
    if not any("stack bytes" in why for why in dropped.get(spills, [])):
        problems.append(f"{spills} not dropped for spilling: {dropped.get(spills)}")
    return problems


@pytest.mark.slow
def test_report_matches_ptxas_and_tuner_prunes():
    check_compile_script(__file__)


if __name__ == "__main__":
    script_main(compile_checks, "the report's figures and the tuner's pruning")
