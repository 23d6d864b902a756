"""The paged attention Triton kernels (store, decode with and without split-KV and its merge, prefill)
compile for sm_90a (H100/H200) at the launches the decoder makes for Qwen3-30B-A3B (8 query heads per KV
head, head_dim 128, 16-token blocks), bf16 and fp32, on a machine without a GPU: a kernel that only the
interpreter accepts fails here, not on the GPU; so does a 16-bit launch that spills registers.

Runs in a subprocess (tests/sm90.py says why)."""

import pytest
from sm90 import check_compile_script, compile_family, script_main


@pytest.mark.slow
def test_paged_attention_kernels_compile_for_sm90_without_spills():
    check_compile_script(__file__)


if __name__ == "__main__":
    script_main(lambda: compile_family("attention"), "the paged attention kernels")
