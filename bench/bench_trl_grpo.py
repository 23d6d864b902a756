"""GRPO seconds per step and peak RSS: livemoe (`python -m train.grpo`, synchronous, in-process rollouts, as a new
user runs it) against TRL's GRPOTrainer (generating with transformers), on the same model and task: the committed
student, the synthetic rooms (64 prompts), K = 8 rollouts of 8 prompts per step, 256 new tokens, temperature 0.7,
β 0.01, loss "grpo", lr 2e-4, the seed's reward (0.4 correct + 0.3 helpful + 0.3 length, TRL given livemoe's
judge and the same L_ref), one CPU thread each; livemoe also with --prompt_sharing false (its update phase before
issue 33). Each side runs in its own process (peak RSS is the process's
ru_maxrss); the pairs alternate. Needs TRL (`pip install -e ".[bench-trl]"`); without it the script says so.

    python -m bench.bench_trl_grpo --steps 6 --repeats 2 --out bench/results/<date>-cpu-trl-grpo
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

STUDENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "livemoe", "train", "assets", "student")
KINDS = ("livemoe", "livemoe_unshared", "trl")  # livemoe_unshared: --prompt_sharing false (the update before it)
COMMON = dict(rooms=64, batch=8, k=8, new_tokens=256, temperature=0.7, beta=0.01, lr=2e-4)


def child_livemoe(steps: int, out: str, extra: tuple = ()) -> dict:
    from livemoe.train.grpo.__main__ import main
    from livemoe.train.metrics import read_metrics

    flags = ["--model", STUDENT, "--output_dir", out, "--train_rooms", str(COMMON["rooms"]), "--eval_rooms", "0",
             "--max_steps", str(steps), "--batch_size", str(COMMON["batch"]), "--num_generations", str(COMMON["k"]),
             "--max_new_tokens", str(COMMON["new_tokens"]), "--temperature", str(COMMON["temperature"]),
             "--beta", str(COMMON["beta"]), "--lr", str(COMMON["lr"]), "--loss_type", "grpo", "--threads", "1",
             "--progress", "false", "--plot", "false", "--save_every", "0", *extra]
    assert main(flags) == 0
    rows = read_metrics(os.path.join(out, "metrics.jsonl"))
    with open(os.path.join(out, "checkpoints", f"step-{steps:08d}", "trainer_state.json")) as f:
        ref_lengths = json.load(f)["ref_lengths"]
    with open(os.path.join(out, "ref_lengths.json"), "w") as f:
        json.dump(ref_lengths, f)
    return {"step_s": [r["time/step_s"] for r in rows], "rollout_s": [r["time/rollout_s"] for r in rows],
            "update_s": [r["time/update_s"] for r in rows], "rewards": [r["reward/mean"] for r in rows]}


def child_trl(steps: int, out: str, ref_lengths_path: str) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from livemoe.train.data import build_prompt
    from livemoe.train.grpo.config import GRPOConfig as OurConfig
    from livemoe.train.grpo.start import load_records
    from livemoe.train.judges import make_judge
    from livemoe.train.rewards import CompositeReward

    torch.set_num_threads(1)
    ours = OurConfig(model=STUDENT, train_rooms=COMMON["rooms"], eval_rooms=0)
    records, _ = load_records(ours)
    tok = AutoTokenizer.from_pretrained(STUDENT)
    by_id = {r["id"]: r for r in records}
    with open(ref_lengths_path) as f:
        ref_lengths = json.load(f)
    reward = CompositeReward(make_judge(ours), ours.reward)

    def seed_reward(prompts, completions, completion_ids, record_id, **_):
        recs = [by_id[i] for i in record_id]
        res = reward(recs, completions, [len(c) for c in completion_ids], [ref_lengths.get(i, 1.0) for i in record_id])
        return [x.reward for x in res]

    data = Dataset.from_list([{"prompt": build_prompt(r, tok), "record_id": r["id"]} for r in records])
    args = GRPOConfig(output_dir=out, per_device_train_batch_size=COMMON["batch"] * COMMON["k"],
                      num_generations=COMMON["k"], max_completion_length=COMMON["new_tokens"],
                      temperature=COMMON["temperature"], beta=COMMON["beta"], learning_rate=COMMON["lr"],
                      loss_type="grpo", max_steps=steps, logging_steps=1, use_cpu=True, bf16=False,
                      report_to="none", save_strategy="no", seed=0, lr_scheduler_type="constant")
    times: list = []

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            times.append(time.perf_counter() - self.t0)

    model = AutoModelForCausalLM.from_pretrained(STUDENT, dtype=torch.float32)
    trainer = GRPOTrainer(model=model, reward_funcs=seed_reward, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[Timer()])
    trainer.train()
    logs = [x for x in trainer.state.log_history if "reward" in x]
    return {"step_s": times, "rewards": [x["reward"] for x in logs]}


def run_child(kind: str, steps: int, out: str, extra: list) -> dict:
    result = os.path.join(out, "result.json")
    cmd = [sys.executable, "-m", "bench.bench_trl_grpo", "--child", kind, "--steps", str(steps), "--child_out", out,
           *extra]
    load = os.getloadavg()[0]
    proc = subprocess.Popen(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"})
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise RuntimeError(f"{kind} failed (status {status})")
    with open(result) as f:
        r = json.load(f)
    r["peak_rss_mb"] = usage.ru_maxrss / 1024  # KiB on Linux
    r["load_avg_1min"] = [load, os.getloadavg()[0]]  # before, after: the machine is shared
    return r


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default="bench/results/cpu-trl-grpo")
    p.add_argument("--child", choices=KINDS)
    p.add_argument("--child_out")
    p.add_argument("--ref_lengths")
    a = p.parse_args(argv)
    if a.child:
        if a.child == "trl":
            r = child_trl(a.steps, a.child_out, a.ref_lengths)
        else:
            r = child_livemoe(a.steps, a.child_out, () if a.child == "livemoe" else ("--prompt_sharing", "false"))
        with open(os.path.join(a.child_out, "result.json"), "w") as f:
            json.dump(r, f)
        return 0
    try:
        import trl  # noqa: F401
    except ImportError:
        print("TRL is not installed: pip install -e '.[bench-trl]'", file=sys.stderr)
        return 2
    os.makedirs(a.out, exist_ok=True)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            ours = run_child("livemoe", a.steps, os.path.join(tmp, f"livemoe{i}"), [])
            unshared = run_child("livemoe_unshared", a.steps, os.path.join(tmp, f"unshared{i}"), [])
            ref = os.path.join(tmp, f"livemoe{i}", "ref_lengths.json")
            theirs = run_child("trl", a.steps, os.path.join(tmp, f"trl{i}"), ["--ref_lengths", ref])
            for kind, r in (("livemoe", ours), ("livemoe_unshared", unshared), ("trl", theirs)):
                r["kind"] = kind
                runs.append(r)
                print(f"{kind} #{i + 1}: median {statistics.median(r['step_s'][1:]):.2f} s/step, peak RSS "
                      f"{r['peak_rss_mb']:.0f} MB", flush=True)
    per = {k: [r for r in runs if r["kind"] == k] for k in KINDS}
    step = {k: statistics.median(s for r in rs for s in r["step_s"][1:]) for k, rs in per.items()}
    rss = {k: max(r["peak_rss_mb"] for r in rs) for k, rs in per.items()}
    import torch
    import trl as trl_mod

    summary = {"steps": a.steps, "repeats": a.repeats, **COMMON, "s_per_step": step, "speedup": step["trl"] / step["livemoe"],
               "peak_rss_mb": rss, "trl": trl_mod.__version__, "torch": torch.__version__, "runs": runs}
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"livemoe {step['livemoe']:.2f} s/step (without prompt sharing {step['livemoe_unshared']:.2f}), TRL "
          f"{step['trl']:.2f} s/step: {summary['speedup']:.2f}x; peak RSS livemoe {rss['livemoe']:.0f} MB "
          f"({rss['livemoe_unshared']:.0f}), TRL {rss['trl']:.0f} MB (steps after the first, median)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
