"""Every MoE Triton kernel compiles for sm_90a (H100/H200) at exactly the launches the dispatch makes for
Qwen3-30B-A3B (T = 1 ... 4096, the heuristic's config for each, forward and backward, bf16 and fp32), on a
machine without a GPU: a kernel that only the interpreter accepts, or that needs more than 227 KiB of shared
memory, fails here, not on the GPU; so does a 16-bit launch that spills registers (stack bytes > 0).

Runs in a subprocess (tests/sm90.py says why)."""

import pytest
from sm90 import check_compile_script, compile_family, script_main


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_spills():
    check_compile_script(__file__)


if __name__ == "__main__":
    script_main(lambda: compile_family("moe"), "all MoE kernels")
