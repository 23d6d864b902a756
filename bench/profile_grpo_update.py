"""Where a GRPO update step's time goes, on bench_async_grpo's task (the committed student, the synthetic rooms, K = 8
rollouts of 8 prompts per step, 256 new tokens, one thread, the trainer's defaults): rolls out a few batches
in-process, runs update_phase on them under torch.profiler, and prints the seconds per update and each share of it
by what it computes (attention forward / backward, the matmuls, the rest), then the top ops.

    python -m bench.profile_grpo_update --steps 3
"""
import argparse
import os
import sys
import tempfile
import time

import torch

from bench.bench_async_grpo import STUDENT

# op -> what it computes (self CPU time; any other op is "other")
KINDS = {"attention forward": ("aten::_scaled_dot_product_flash_attention_for_cpu",),
         "attention backward": ("aten::_scaled_dot_product_flash_attention_for_cpu_backward",),
         "matmuls": ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::_grouped_mm"),
         "elementwise": ("aten::mul", "aten::mul_", "aten::add", "aten::add_", "aten::div", "aten::sub",
                         "aten::where", "aten::pow", "aten::sigmoid", "aten::lerp_", "aten::_softmax",
                         "aten::_softmax_backward_data"),
         "copies, cats, fills": ("aten::copy_", "aten::cat", "aten::fill_", "aten::index", "aten::_index_put_impl_",
                                 "aten::index_select", "aten::index_add_")}
KIND_OF = {op: kind for kind, ops in KINDS.items() for op in ops}


def main(argv=None) -> int:
    from livemoe.train.config import parse_config
    from livemoe.train.grpo.config import GRPOConfig
    from livemoe.train.grpo.trainer import GRPOTrainer
    from torch.profiler import ProfilerActivity, profile

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=3, help="updates profiled (after one warm-up)")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as out:
        cfg = parse_config(GRPOConfig, ["--model", STUDENT, "--output_dir", out, "--train_rooms", "64",
                                        "--eval_rooms", "0", "--max_steps", str(a.steps + 1), "--max_new_tokens",
                                        "256", "--threads", "1", "--progress", "false", "--plot", "false"])
        trainer = GRPOTrainer(cfg)
        trainer.compute_reference_lengths()
        batches = [trainer.rollout_phase(s)[0] for s in range(a.steps + 1)]
        trainer.update_phase(batches[0])  # warm-up
        times = []
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for b in batches[1:]:
                t0 = time.perf_counter()
                trainer.update_phase(b)
                times.append(time.perf_counter() - t0)
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    shares: dict = {}
    for e in events:
        k = KIND_OF.get(e.key, "other")
        shares[k] = shares.get(k, 0.0) + e.self_cpu_time_total
    rows = batches[1]["input_ids"].shape
    print(f"update: {sum(times) / len(times):.3f} s per step (profiled), {rows[0]} rows of up to {rows[1]} tokens; "
          f"load {os.getloadavg()[0]:.1f}")
    for k, v in sorted(shares.items(), key=lambda kv: -kv[1]):
        print(f"  {k:22s} {100 * v / total:5.1f}%")
    print(events.table(sort_by="self_cpu_time_total", row_limit=15))
    return 0


if __name__ == "__main__":
    sys.exit(main())
