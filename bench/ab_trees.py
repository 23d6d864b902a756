"""Text-only decode speed of two checkouts of livemoe, alternately in fresh processes (a code change cannot be
timed against its own parent in one process). Each run: the small random Qwen3-MoE of bench_decode (fp32, one
thread), 16 requests x 64 greedy tokens after a warm-up, the best of three in the process; the figure is tok/s.
Medians of --reps runs of each side.

    python bench/ab_trees.py /path/to/baseline/checkout . --reps 5

End-to-end figures on a shared machine vary by +-20% between processes; `--plan` times what a text decode step
changed in (ModelRunner.plan, the host-side step inputs) in one process instead: the baseline checkout's
model_runner.py loaded beside ours, both planning the same 64-sequence decode step, alternately, 2000 times each.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

RUN = r'''
import json, sys, time, torch
sys.path.insert(0, "tests"); sys.path.insert(0, ".")
from bench.bench_decode import MODELS, random_prompts
from livemoe import LLM, SamplingParams
torch.set_num_threads(1)
llm = LLM(sys.argv[1], dtype=torch.float32, device="cpu", num_kv_blocks=2048, use_tqdm=False)
prompts = random_prompts(16, 8, 48, 4096)
params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=4))
best = 0.0
for _ in range(3):  # the best of three: the least disturbed by the machine's other work
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params)
    best = max(best, 16 * 64 / (time.perf_counter() - t0))
print(json.dumps({"tok_s": best, "tokens": [o.outputs[0].token_ids for o in outs]}))
'''


def run(root: str, ckpt: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.path.abspath(root), OMP_NUM_THREADS="1")
    out = subprocess.run([sys.executable, "-c", RUN, ckpt], cwd=os.path.dirname(os.path.dirname(__file__)) or ".",
                         env=env, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def plan_ab(baseline: str) -> dict:
    """Both plan() functions on one decode step, in this process (ours: the livemoe on sys.path)."""
    import importlib.util
    import time

    from livemoe.engine.decoder.model_runner import ModelRunner
    from livemoe.engine.decoder.scheduler import SchedulerOutput
    from livemoe.engine.decoder.sequence import Sequence
    from livemoe.engine.sampling.params import SamplingParams

    spec = importlib.util.spec_from_file_location(
        "baseline_model_runner", os.path.join(baseline, "livemoe/engine/decoder/model_runner.py"))
    base = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(base)
    seqs = []
    for i in range(64):
        seq = Sequence(list(range(3, 40 + i)), SamplingParams())
        seq.num_computed_tokens = len(seq) - 1
        seq.block_table = list(range(i * 8, i * 8 + (len(seq) + 15) // 16))
        seqs.append(seq)
    out = SchedulerOutput(seqs, [1] * 64)
    runners = {}
    for name, cls in (("baseline", base.ModelRunner), ("ours", ModelRunner)):
        runner = cls.__new__(cls)
        runner.block_size = 16
        runner.multimodal = False  # a text model's engine
        runners[name] = runner
    times: dict[str, list] = {"baseline": [], "ours": []}
    for _ in range(2000):
        for name, runner in runners.items():
            t0 = time.perf_counter()
            runner.plan(out)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) * 1e6 for k, v in times.items()}
    same = bytes(runners["ours"].plan(out).longs) == bytes(runners["baseline"].plan(out).longs)
    return {"median_plan_us": med, "ours_over_baseline": med["ours"] / med["baseline"], "same_step_inputs": same}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("baseline")
    p.add_argument("ours")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--plan", action="store_true", help="time ModelRunner.plan of both in this process")
    args = p.parse_args()
    if args.plan:
        print(json.dumps(plan_ab(args.baseline), indent=1))
        return
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
    from bench.bench_decode import MODELS
    from tiny_models import make_checkpoint

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_checkpoint(os.path.join(tmp, "small"), moe=True, **MODELS["small MoE"])[0]
        runs: dict[str, list] = {"baseline": [], "ours": []}
        for _ in range(args.reps):
            for side in ("baseline", "ours"):
                runs[side].append(run(getattr(args, side), ckpt))
        same = runs["baseline"][-1]["tokens"] == runs["ours"][-1]["tokens"]
        med = {side: statistics.median(r["tok_s"] for r in rs) for side, rs in runs.items()}
        print(json.dumps({"median_tok_s": med, "ours_over_baseline": med["ours"] / med["baseline"],
                          "all_tok_s": {s: [round(r["tok_s"], 1) for r in rs] for s, rs in runs.items()},
                          "same_tokens": same}, indent=1))


if __name__ == "__main__":
    main()
