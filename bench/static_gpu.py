"""A static resource report for every Triton kernel the dispatch launches at Qwen3-30B-A3B's shapes, compiled
here for sm_90a (H100/H200) with no GPU: registers per thread, stack bytes (local memory, where spilled
registers go), shared memory, and the theoretical occupancy those allow; beside it the roofline model
(bench/roofline.py) of the kernels and of the batch-1 MoE layer.

    python -m bench.static_gpu [--out bench/out] [--family moe logprobs attention exact rejection] [--dtype bf16 fp32]

writes static_gpu.{md,json} to the output folder. Registers and stack come from `cuobjdump -res-usage` on
the cubin (the tool ships with Triton's NVIDIA backend), shared memory from Triton's metadata (the
dynamic shared memory it launches with) plus the cubin's static shared memory. Compiled kernels land in
Triton's cache (~/.triton/cache), so a second run takes seconds.
"""
import argparse
import json
import os
import sys
from dataclasses import asdict

import torch

from livemoe.kernels.static_resources import SIXTEEN_BIT, Resources, measure_launch, problems

def report(rows: list[Resources], bare: dict, roofline: list[dict], shapes) -> str:
    """Markdown: the resource table (with, for 16-bit launches, what the bare signature would give), then the
    roofline table."""
    from bench.roofline import markdown_table

    lines = ["# Static sm_90a resources of the Triton kernels at Qwen3-30B-A3B shapes", "",
             f"Compiled with triton {_triton_version()} for sm_90a, no GPU, each launch specialised as Triton's JIT "
             "specialises it (ints equal to 1 as constants, divisibility-by-16 hints). Registers and stack from "
             "`cuobjdump -res-usage` on the cubin; shared memory from Triton's metadata plus static shared memory; "
             "occupancy: resident warps per SM of 64 under sm_90's limits (64K registers, 228 KiB shared memory, "
             "32 blocks). 'bare' compiles the same launch without the launch's hints (what the compile tests used "
             "to build): the spills the issue listed come from there.", "",
             "| kernel | case | warps | stages | registers | stack B | shared KiB | warps/SM | occupancy | limited by "
             "| bare: registers / stack B |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: |"]
    for r in rows:
        b = bare.get((r.kernel, r.case))
        b_text = f"{b.registers} / {b.stack_bytes}" if b is not None and not b.error else ""
        if r.error and not r.registers:
            lines.append(f"| `{r.kernel}` | {r.case} | {r.num_warps} | {r.num_stages} | FAILED: {r.error[:120]} "
                         "| | | | | | |")
            continue
        lines.append(f"| `{r.kernel}` | {r.case} | {r.num_warps} | {r.num_stages} | {r.registers} | {r.stack_bytes} | "
                     f"{r.shared_bytes / 1024:.1f} | {r.occupancy_warps} | {r.occupancy:.0%} | {r.limited_by} | "
                     f"{b_text} |")
    spilling = [r for r in rows if r.stack_bytes]
    bare_spilling = [b for b in bare.values() if b.stack_bytes]
    lines += ["", f"{len(rows)} launches, {len(spilling)} with stack bytes "
              f"({sum(r.dtype in SIXTEEN_BIT for r in spilling)} of them 16-bit); compiled bare, "
              f"{len(bare_spilling)} of the {len(bare)} 16-bit launches spill.", "",
              markdown_table(roofline, shapes)]
    return "\n".join(lines) + "\n"


def _triton_version() -> str:
    import triton

    return triton.__version__


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "out"))
    p.add_argument("--family", nargs="+", default=["moe", "logprobs", "attention", "exact", "rejection"],
                   choices=["moe", "logprobs", "attention", "exact", "rejection"])
    p.add_argument("--dtype", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32"])
    args = p.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise SystemExit("unset TRITON_INTERPRET: the report compiles the kernels, the interpreter does not")
    from bench.kernel_launches import Qwen3Shapes, all_launches
    from bench.roofline import roofline_rows

    dtypes = tuple({"bf16": torch.bfloat16, "fp32": torch.float32}[d] for d in args.dtype)
    launches = all_launches(Qwen3Shapes(), tuple(args.family), dtypes)
    rows, bare = [], {}
    for launch in launches:
        r = measure_launch(launch)
        rows.append(r)
        if r.dtype in SIXTEEN_BIT:
            bare[(r.kernel, r.case)] = measure_launch(launch, hints=False)
        print(f"{r.kernel:28s} {r.case:36s} reg {r.registers:3d} stack {r.stack_bytes:5d} "
              f"shared {r.shared_bytes:6d} warps/SM {r.occupancy_warps:2d} {r.error[:80]}", file=sys.stderr)
    shapes = Qwen3Shapes()
    roof = roofline_rows(shapes)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "static_gpu.json"), "w") as f:
        json.dump({"triton": _triton_version(), "target": "sm_90a", "shapes": asdict(shapes),
                   "kernels": [{**asdict(r), "bare": asdict(bare[(r.kernel, r.case)]) if (r.kernel, r.case) in bare
                                else None} for r in rows], "roofline": roof}, f, indent=1)
    with open(os.path.join(args.out, "static_gpu.md"), "w") as f:
        f.write(report(rows, bare, roof, shapes))
    bad = problems(rows)
    print("\n".join(bad) or "no spills in any 16-bit launch; every launch fits shared memory")
    print(f"wrote {args.out}/static_gpu.{{md,json}}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
