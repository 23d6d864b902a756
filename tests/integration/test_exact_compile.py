"""The exact mode's Triton kernels (livemoe/kernels/batch_invariant/*.py: linear, RMSNorm, SiLU*mul, rope,
log-softmax, routing, attention, the experts' grouped GEMMs at their one config and the top-k combine) compile for
sm_90a (H100/H200) at Qwen3-30B-A3B's shapes, bf16 and fp32, on a machine without a GPU, and no 16-bit launch
spills registers.

Runs in a subprocess (tests/sm90.py says why)."""

import pytest
from sm90 import check_compile_script, compile_family, script_main


@pytest.mark.slow
def test_exact_mode_kernels_compile_for_sm90_without_spills():
    check_compile_script(__file__)


if __name__ == "__main__":
    script_main(lambda: compile_family("exact"), "the exact mode's kernels")
