"""What the experiments share: their options, one arm = one run of `livemoe.train.rft` or `livemoe.train.grpo` through the
trainer's own config parser and entry point (so an arm is exactly the command its report prints), and the
report: README.md (the table, the command, the date, the machine, each arm's trainer command),
results.json (the same numbers) and the PNG where there is one."""
import datetime
import json
import os
import platform
import shlex
import time
from dataclasses import dataclass, field

from livemoe.train.config import DEFAULT_STUDENT, parse_config
from livemoe.train.rft.config import RFTConfig

# the committed reports, beside the code (experiments/ is a checkout's folder: never installed)
RESULTS_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")

# The --tiny sizes: seconds on a CPU with a tiny student (the suite's), every stage still run. Held-out
# rows are greedy (one response each) and short; the experiments' own flags come after these.
TINY_SHARED = ["--train_rooms", "6", "--eval_rooms", "2", "--eval_max_new_tokens", "8", "--eval_temperature", "0",
               "--eval_samples", "1", "--plot", "false", "--warmup_steps", "0"]
TINY_RFT = [*TINY_SHARED, "--k", "2", "--batch_size", "2", "--max_steps", "2", "--max_len", "512"]
TINY_GRPO = [*TINY_SHARED, "--batch_size", "2", "--num_generations", "2", "--max_new_tokens", "8", "--max_steps", "1",
             "--ref_samples", "1", "--rollout_kv_bytes", str(8 * 2**20), "--micro_batch_size", "4"]

# The full GRPO arms of length_sweep and reward_ablation: 40 steps of 4 prompts x 8 rollouts at the default
# lr 2e-4 (the default runs 40 steps of 8 prompts, 60 before 2026-12-02: this is half its rollouts and all of
# its lr x steps), held-out rows of 64 rooms x 2 samples. A step takes ~4-5 s on this 2-core CPU shared with other
# jobs (load average ~8), so 3-4 arms fit in about 15 minutes. (At lr 1.5e-3 for 8 steps, tried first, the
# KL to the start reached ~1.8 and the arms' lengths went anywhere: too fast a step for this student.)
# Without --start they begin from the RFT default, as `make demo` runs it.
FULL_GRPO = ["--max_steps", "40", "--batch_size", "4", "--eval_samples", "2"]
FULL_RFT_START: list = []
GRPO_SIZE_NOTE = """Sized for a shared 2-core CPU: each full arm runs 40 GRPO steps of 4 prompts x 8 rollouts at the default
lr 2e-4 (the default run: 40 steps of 8 prompts), half the default's rollouts, and differences of a few
points are within the held-out noise."""


class ExperimentError(ValueError):
    """A bad experiment name or option: the message names it."""


@dataclass(kw_only=True)
class ExperimentArgs:
    """One experiment's run: what `python -m experiments NAME [flags]` parsed."""
    name: str
    tiny: bool = False
    output_dir: str = ""  # the report; "" = RESULTS_ROOT/NAME (RESULTS_ROOT/NAME/tiny with --tiny)
    work_dir: str = ""  # the trainers' runs (checkpoints, metrics); "" = runs/experiments/NAME
    model: str = DEFAULT_STUDENT  # the base student every arm starts from
    start: str = ""  # GRPO experiments: the RFT student to start from; "" = run livemoe.train.rft first (work_dir/rft)
    seed: int = 0
    progress: bool = True
    command: str = ""  # as typed, for the report
    started: float = field(default_factory=time.time)
    load_at_start: tuple = field(default_factory=lambda: os.getloadavg() if hasattr(os, "getloadavg") else ())

    def __post_init__(self):
        suffix = os.path.join(self.name, "tiny") if self.tiny else self.name
        self.output_dir = self.output_dir or os.path.join(RESULTS_ROOT, suffix)
        self.work_dir = self.work_dir or os.path.join("runs", "experiments", suffix)
        self.model, self.start = shown(self.model), shown(self.start)
        if not os.path.isfile(os.path.join(self.model, "config.json")):
            raise ExperimentError(f"--model {self.model}: not a checkpoint directory (no config.json)")
        if self.start and not os.path.isfile(os.path.join(self.start, "config.json")):
            raise ExperimentError(f"--start {self.start}: not a checkpoint directory (no config.json)")


def shown(path: str) -> str:
    """`path` relative to the working directory when it lies under it (reports and commands read as from
    the repository root, not as from this machine's checkout)."""
    if not path or not os.path.isabs(path) or not path.startswith(os.getcwd() + os.sep):
        return path
    return os.path.relpath(path)


@dataclass(kw_only=True)
class Arm:
    """One trainer run of an experiment: its name, the trainer's command line and what the run returned."""
    name: str
    command: str
    output_dir: str
    result: dict


def _flags(args: ExperimentArgs, arm: str, model: str, sizes: list, flags: list) -> list:
    """The trainer's argv: the arm's place and start, then the sizes, then the arm's own flags (a flag given
    twice: the last wins, as on a command line)."""
    return ["--model", model, "--output_dir", os.path.join(args.work_dir, arm), "--seed", str(args.seed),
            "--progress", str(args.progress).lower(), *sizes, *map(str, flags)]


def announce(args: ExperimentArgs, arm: str, command: str) -> None:
    print(f"[experiments] {args.name} / {arm}: {command}", flush=True)


def run_rft(args: ExperimentArgs, arm: str, sizes: list, flags: list = (), model: str = "") -> Arm:
    """livemoe.train.rft's own run() (rft.trainer.run) on the config its parser makes of the flags."""
    from livemoe.train.rft import trainer as rft

    argv = _flags(args, arm, model or args.model, sizes, list(flags))
    cfg = parse_config(RFTConfig, argv, prog="python -m train.rft")
    command = "python -m train.rft " + shlex.join(argv)
    announce(args, arm, command)
    return Arm(name=arm, command=command, output_dir=cfg.output_dir, result=rft.run(cfg))


def run_grpo(args: ExperimentArgs, arm: str, start: str, sizes: list, flags: list = (), shared: dict | None = None) -> Arm:
    """livemoe.train.grpo's own trainer on the config its parser makes of the flags. Arms of one experiment start from
    one checkpoint with one seed and the same prompts, so `shared` carries the first arm's L_ref and
    held-out start row to the next ones (the same numbers, computed once)."""
    from livemoe.train.grpo.config import GRPOConfig
    from livemoe.train.grpo.trainer import GRPOTrainer

    argv = _flags(args, arm, start, sizes, list(flags))
    cfg = parse_config(GRPOConfig, argv, prog="python -m train.grpo")
    command = "python -m train.grpo " + shlex.join(argv)
    announce(args, arm, command)
    trainer = GRPOTrainer(cfg)
    shared = {} if shared is None else shared
    trainer.ref_lengths.update(shared.get("ref_lengths", {}))
    if shared.get("before") is not None:
        trainer.before = shared["before"]
    summary = trainer.train()
    shared.setdefault("ref_lengths", dict(trainer.ref_lengths))
    shared.setdefault("before", trainer.before)
    return Arm(name=arm, command=command, output_dir=cfg.output_dir, result=summary)


def rft_start(args: ExperimentArgs, sizes: list) -> tuple:
    """(the RFT student a GRPO experiment starts from, the Arm that made it or None): --start, else a
    livemoe.train.rft run of `sizes` into work_dir/rft."""
    if args.start:
        return args.start, None
    arm = run_rft(args, "rft", sizes)
    return arm.result["final_dir"], arm


def logged(arm: Arm, key: str) -> list:
    """(step, value) of every row of the arm's metrics.jsonl that logged `key`."""
    from livemoe.train.metrics import read_metrics

    return [(r["step"], r[key]) for r in read_metrics(os.path.join(arm.output_dir, "metrics.jsonl")) if key in r]


def tokens_trained(arm: Arm) -> int:
    """Tokens (prompt + completion) the arm's optimizer steps saw."""
    return int(sum(v for _, v in logged(arm, "tokens")))


# ------------------------------------------------------------------------------------------ the report
def machine(load_at_start: tuple = ()) -> str:
    """The CPU (or GPU), cores, memory, torch, and the load average at the start and now: figures taken on a
    shared machine, and the load says how shared."""
    import torch

    cpu = platform.processor() or platform.machine()
    if os.path.isfile("/proc/cpuinfo"):
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    mem = ""
    if hasattr(os, "sysconf") and "SC_PHYS_PAGES" in os.sysconf_names:
        mem = f", {os.sysconf('SC_PHYS_PAGES') * os.sysconf('SC_PAGE_SIZE') / 2**30:.0f} GiB"
    gpu = f", GPU {torch.cuda.get_device_name(0)}" if torch.cuda.is_available() else ", no GPU"
    load = ""
    if hasattr(os, "getloadavg"):
        load = "; load average (1, 5, 15 min) " + (f"{_triple(load_at_start)} at the start, " if load_at_start else "")
        load += f"{_triple(os.getloadavg())} at the end"
    return f"{cpu}, {os.cpu_count()} cores{mem}{gpu}; torch {torch.__version__}, Python {platform.python_version()}{load}"


def _triple(xs) -> str:
    return " / ".join(f"{x:.1f}" for x in xs)


def markdown_table(columns: list, rows: list, decimals: dict | None = None) -> str:
    """Rows of cells under the column names; floats with decimals[column] decimals (default one)."""
    assert columns and all(len(r) == len(columns) for r in rows), (columns, rows)
    digits = [(decimals or {}).get(c, 1) for c in columns]

    def cell(x, d):
        return f"{x:.{d}f}" if isinstance(x, float) else str(x)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    return "\n".join(lines + ["| " + " | ".join(cell(x, d) for x, d in zip(r, digits)) + " |" for r in rows])


def write_report(args: ExperimentArgs, title: str, columns: list, rows: list, notes: str, arms: list,
                 png: str | None = None, decimals: dict | None = None) -> str:
    """README.md and results.json under args.output_dir; returns the README's path. `decimals`: see
    markdown_table."""
    os.makedirs(args.output_dir, exist_ok=True)
    minutes = (time.time() - args.started) / 60
    date = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")
    parts = [f"# {args.name}: {title}", "",
             f"- command: `{args.command}`",
             f"- date: {date}, {minutes:.1f} minutes wall",
             f"- machine: {machine(args.load_at_start)}", "",
             markdown_table(columns, rows, decimals), ""]
    if png:
        parts += [f"![{args.name}]({os.path.basename(png)})", ""]
    parts += [notes.strip(), "", "## Each arm's trainer command", "", "```bash",
              *[a.command for a in arms], "```", ""]
    path = os.path.join(args.output_dir, "README.md")
    with open(path, "w") as f:
        f.write("\n".join(parts))
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump({"experiment": args.name, "command": args.command, "date": date, "minutes": round(minutes, 2),
                   "machine": machine(args.load_at_start), "columns": columns, "rows": rows,
                   "arms": {a.name: a.command for a in arms}}, f, indent=1)
    print(f"[experiments] {args.name}: report written to {path}", flush=True)
    return path


def plot_panels(path: str, title: str, xlabel: str, panels: list, log_y: bool = False) -> str | None:
    """One row of panels, each (y label, {line label: (xs, ys, point labels or None)}); None (and a line
    saying so) without matplotlib."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG, the table only", flush=True)
        return None
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    fig, axes = plt.subplots(1, len(panels), figsize=(max(7.0, 4.5 * len(panels)), 3.6), squeeze=False)
    for ax, (ylabel, lines) in zip(axes[0], panels):
        for label, (xs, ys, point_labels) in lines.items():
            ax.plot(xs, ys, marker="o", label=label)
            for x, y, text in zip(xs, ys, point_labels or []):
                ax.annotate(text, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
        if log_y:
            ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if len(lines) > 1:
            ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
