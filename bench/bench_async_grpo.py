"""GRPO steps per hour, synchronous against asynchronous (`--async_rollouts --max_staleness 1`), on the demo's task
on the CPU: the committed student, the synthetic rooms, K = 8 rollouts of 8 prompts per step, 256 new tokens.

Two processes: the trainer (this one, one thread) and one rollout server's engine core (its own process, one
thread; the HTTP front runs in the trainer's process, as BackgroundServer does), with `--rollout_url` and the
weights pushed over a gloo group after each step. Sync: the server decodes while the trainer waits, then the trainer
updates while the server waits. Async S = 1: the server decodes step t+1's batch while the trainer updates step t.
The runs alternate (sync, async, sync, async, ...) on a fresh server each, as the machine is shared and noisy.
Writes <out>/results.json and <out>/reward_curves.{csv,png} (the per-step mean reward of each run, side by side).

    python -m bench.bench_async_grpo --steps 12 --repeats 2 --out bench/results/<date>-cpu-async-grpo
"""
import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import torch

STUDENT = os.path.join(os.path.dirname(__file__), "..", "livemoe", "train", "assets", "student")


def run_once(mode: str, steps: int, out_dir: str, new_tokens: int) -> dict:
    from livemoe.engine.async_llm import AsyncLLM
    from livemoe.engine.server import BackgroundServer, ServerConfig
    from livemoe.train.grpo.__main__ import main
    from livemoe.train.metrics import read_metrics

    engine = AsyncLLM(STUDENT, engine_core="process", dtype=torch.float32, device="cpu", use_tqdm=False, threads=1,
                      kv_cache_bytes=256 * 2**20)
    srv = BackgroundServer(engine, "student", config=ServerConfig(enable_admin_routes=True)).start()
    try:
        flags = ["--model", STUDENT, "--output_dir", out_dir, "--train_rooms", "64", "--eval_rooms", "0",
                 "--max_steps", str(steps), "--max_new_tokens", str(new_tokens), "--threads", "1",
                 "--progress", "false", "--plot", "false", "--rollout_url", srv.url, "--save_every", "0"]
        if mode == "async":
            flags += ["--async_rollouts", "true", "--max_staleness", "1"]
        t0 = time.perf_counter()
        assert main(flags) == 0, mode
        wall = time.perf_counter() - t0
    finally:
        srv.stop()
        engine.shutdown()
    rows = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    step_s = [r["time/step_s"] for r in rows]
    return {"mode": mode, "wall_s": wall, "step_s": step_s, "loop_s": sum(step_s),
            "steps_per_hour": 3600 * len(step_s) / sum(step_s), "rewards": [r["reward/mean"] for r in rows],
            "update_s": [r.get("time/update_s", 0.0) for r in rows], "rollout_s": [r["time/rollout_s"] for r in rows]}


def write_curves(out: str, runs: list) -> None:
    steps = len(runs[0]["rewards"])
    names = [f"{r['mode']}#{i // 2 + 1}" for i, r in enumerate(runs)]
    with open(os.path.join(out, "reward_curves.csv"), "w") as f:
        f.write("step," + ",".join(names) + "\n")
        for s in range(steps):
            f.write(f"{s + 1}," + ",".join(f"{r['rewards'][s]:.4f}" for r in runs) + "\n")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, r in zip(names, runs):
        ax.plot(range(1, steps + 1), r["rewards"], label=name, color="C0" if r["mode"] == "sync" else "C1",
                linestyle="-" if name.endswith("#1") else "--")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("mean rollout reward")
    ax.set_title("sync vs async (S = 1), demo task, CPU")
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "reward_curves.png"), dpi=100)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--repeats", type=int, default=2, help="sync/async pairs, alternating")
    p.add_argument("--new_tokens", type=int, default=256)
    p.add_argument("--out", default="bench/results/cpu-async-grpo")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(1)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            for mode in ("sync", "async"):
                load = os.getloadavg()[0]
                r = run_once(mode, a.steps, os.path.join(tmp, f"{mode}{i}"), a.new_tokens)
                r["load_avg_1min"] = [load, os.getloadavg()[0]]  # before, after: the machine is shared
                runs.append(r)
                print(f"{mode} #{i + 1}: {r['steps_per_hour']:.0f} steps/h ({r['loop_s']:.1f} s for {a.steps} steps), "
                      f"final reward {r['rewards'][-1]:.3f}, load {load:.1f}", flush=True)
    per = {m: [r for r in runs if r["mode"] == m] for m in ("sync", "async")}
    rate = {m: statistics.median(r["steps_per_hour"] for r in rs) for m, rs in per.items()}
    tail = {m: statistics.mean(x for r in rs for x in r["rewards"][-3:]) for m, rs in per.items()}
    summary = {"steps": a.steps, "repeats": a.repeats, "new_tokens": a.new_tokens,
               "steps_per_hour": rate, "speedup": rate["async"] / rate["sync"],
               "reward_last3_mean": tail, "python": sys.version.split()[0], "torch": torch.__version__,
               "runs": runs}
    with open(os.path.join(a.out, "results.json"), "w") as f:
        json.dump(summary, f, indent=1)
    write_curves(a.out, runs)
    print(f"async / sync: {summary['speedup']:.2f}x steps per hour; reward of the last 3 steps: sync "
          f"{tail['sync']:.3f}, async {tail['async']:.3f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
