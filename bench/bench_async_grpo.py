"""GRPO steps per hour, synchronous against asynchronous (`--async_rollouts --max_staleness 1`), on the demo's task
on the CPU: the committed student, the synthetic rooms, K = 8 rollouts of 8 prompts per step, 256 new tokens.

Two processes: the trainer (this one, one thread) and one rollout server's engine core (its own process, one
thread; the HTTP front runs in the trainer's process, as BackgroundServer does), with `--rollout_url` and the
weights pushed over a gloo group after each step. Sync: the server decodes while the trainer waits, then the trainer
updates while the server waits. Async S = 1: the server decodes step t+1's batch while the trainer updates step t.
The runs alternate (sync, async, sync, async, ...) on a fresh server each, as the machine is shared and noisy.
With --pin (the default where 2 CPUs are allowed) each process runs on a core of its own, every thread of it: the
trainer's (its HTTP front and producer thread too) on the first, the engine core's on the second, so async can
overlap the two instead of the scheduler spreading both over both cores; each run records the 1-minute load
average before and after, and how much CPU each process got (CPU seconds / wall seconds: 1.0 is a whole core).
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


def pin(pid: int, cpus: set) -> None:
    """Every thread of process `pid` onto `cpus` (a thread it starts later inherits its starter's)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except (ProcessLookupError, FileNotFoundError):  # a thread that ended meanwhile
            pass


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far (all its threads)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def run_once(mode: str, steps: int, out_dir: str, new_tokens: int, cores: tuple | None = None) -> dict:
    from livemoe.engine.async_llm import AsyncLLM
    from livemoe.engine.server import BackgroundServer, ServerConfig
    from livemoe.train.grpo.__main__ import main
    from livemoe.train.metrics import read_metrics

    engine = AsyncLLM(STUDENT, engine_core="process", dtype=torch.float32, device="cpu", use_tqdm=False, threads=1,
                      kv_cache_bytes=256 * 2**20)
    srv = BackgroundServer(engine, "student", config=ServerConfig(enable_admin_routes=True)).start()
    core_pid = engine.core_pids()[0]
    if cores is not None:  # the trainer (this process) on one core, the engine core on the other
        pin(os.getpid(), {cores[0]})
        pin(core_pid, {cores[1]})
    cpu0 = (cpu_seconds(os.getpid()), cpu_seconds(core_pid))
    try:
        flags = ["--model", STUDENT, "--output_dir", out_dir, "--train_rooms", "64", "--eval_rooms", "0",
                 "--max_steps", str(steps), "--max_new_tokens", str(new_tokens), "--threads", "1",
                 "--progress", "false", "--plot", "false", "--rollout_url", srv.url, "--save_every", "0"]
        if mode == "async":
            flags += ["--async_rollouts", "true", "--max_staleness", "1"]
        t0 = time.perf_counter()
        assert main(flags) == 0, mode
        wall = time.perf_counter() - t0
        cpu = (cpu_seconds(os.getpid()) - cpu0[0], cpu_seconds(core_pid) - cpu0[1])
    finally:
        srv.stop()
        engine.shutdown()
    rows = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    step_s = [r["time/step_s"] for r in rows]
    return {"mode": mode, "wall_s": wall, "step_s": step_s, "loop_s": sum(step_s), "pinned_cores": cores,
            "cpu_share": {"trainer": cpu[0] / wall, "engine_core": cpu[1] / wall},
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
    p.add_argument("--pin", action=argparse.BooleanOptionalAction, default=None,
                   help="the trainer and the engine core each on a core of its own (default: when 2 are allowed)")
    a = p.parse_args(argv)
    allowed = sorted(os.sched_getaffinity(0))
    if a.pin and len(allowed) < 2:
        p.error(f"--pin needs 2 allowed CPUs, this process may use {allowed}")
    cores = tuple(allowed[:2]) if (a.pin is None and len(allowed) >= 2) or a.pin else None
    os.makedirs(a.out, exist_ok=True)
    torch.set_num_threads(1)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(a.repeats):
            for mode in ("sync", "async"):
                load = os.getloadavg()[0]
                r = run_once(mode, a.steps, os.path.join(tmp, f"{mode}{i}"), a.new_tokens, cores)
                r["load_avg_1min"] = [load, os.getloadavg()[0]]  # before, after: the machine is shared
                runs.append(r)
                share = r["cpu_share"]
                print(f"{mode} #{i + 1}: {r['steps_per_hour']:.0f} steps/h ({r['loop_s']:.1f} s for {a.steps} steps), "
                      f"final reward {r['rewards'][-1]:.3f}, load {load:.1f}, CPU share trainer "
                      f"{share['trainer']:.2f} engine core {share['engine_core']:.2f}", flush=True)
    per = {m: [r for r in runs if r["mode"] == m] for m in ("sync", "async")}
    rate = {m: statistics.median(r["steps_per_hour"] for r in rs) for m, rs in per.items()}
    tail = {m: statistics.mean(x for r in rs for x in r["rewards"][-3:]) for m, rs in per.items()}
    summary = {"steps": a.steps, "repeats": a.repeats, "new_tokens": a.new_tokens, "pinned_cores": cores,
               "cpus": os.cpu_count(),
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
