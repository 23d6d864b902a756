"""The rejection sampler's Triton kernels (livemoe/kernels/rejection_sampler.py) compile for sm_90a (H100/H200) at
the launches speculative verification makes for Qwen3-30B-A3B's vocabulary, with draft probabilities and with point
masses, on a machine without a GPU, and spill nothing (they take fp32 probabilities whatever the model's dtype, so
the no-spill rule is checked here for fp32 too).

Runs in a subprocess (tests/sm90.py says why)."""

import pytest
from sm90 import check_compile_script, compile_family, script_main


@pytest.mark.slow
def test_rejection_sampler_kernels_compile_for_sm90_without_spills():
    check_compile_script(__file__)


def compile_without_spills() -> list[str]:
    from bench.kernel_launches import all_launches
    from livemoe.kernels.static_resources import measure_launch

    problems = compile_family("rejection")
    rows = [measure_launch(launch) for launch in all_launches(families=("rejection",))]
    return problems + [f"{r.kernel} {r.case}: {r.stack_bytes} stack bytes" for r in rows if r.stack_bytes]


if __name__ == "__main__":
    script_main(compile_without_spills, "the rejection sampler kernels")
