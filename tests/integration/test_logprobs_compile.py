"""The Triton log-prob kernels compile for sm_90a (H100/H200) here, with no GPU, at the launches
fused_linear_logprobs makes for Qwen3-30B-A3B's lm_head (N = 8192, V = 151,936, H = 2048, with a mask,
with and without entropy), bf16 and fp32: the interpreter tests check their numbers but not what only the
compiler rejects (non-constexpr globals, types, shapes of tl.dot), nor register spills (a 16-bit launch
with stack bytes fails).

Runs in a subprocess (tests/sm90.py says why)."""

import pytest
from sm90 import check_compile_script, compile_family, script_main


@pytest.mark.slow
def test_triton_kernels_compile_for_sm90_without_spills():
    check_compile_script(__file__)


if __name__ == "__main__":
    script_main(lambda: compile_family("logprobs"), "the log-prob kernels")
