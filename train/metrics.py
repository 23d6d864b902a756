"""Per-step metrics: one JSON line per step (metrics.jsonl), TensorBoard if asked, PNG curves at the end.

metrics.jsonl is strict JSON: a NaN or Inf value (a diverged step's loss) is written as null, which
JSON readers take as "no value" (pandas reads it as NaN); the step's `nonfinite_steps` says it was skipped."""
import json
import math
import os


class MetricsLogger:
    def __init__(self, output_dir: str, tensorboard: bool = False, resume_step: int | None = None,
                 filename: str = "metrics.jsonl"):
        os.makedirs(output_dir, exist_ok=True)
        self.output_dir, self.path = output_dir, os.path.join(output_dir, filename)
        if resume_step is not None and os.path.exists(self.path):
            # a resumed run rewrites what came after its checkpoint, so the log reads as one run
            kept = [r for r in read_metrics(self.path) if r.get("step", 0) <= resume_step]
            with open(self.path + ".tmp", "w") as f:
                f.writelines(json.dumps(r) + "\n" for r in kept)
            os.replace(self.path + ".tmp", self.path)
        elif resume_step is None and os.path.exists(self.path):
            os.remove(self.path)
        self._f = open(self.path, "a")
        self._tb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(os.path.join(output_dir, "tensorboard"))
            except ImportError:
                print("tensorboard is not installed: metrics go to metrics.jsonl only")

    def log(self, step: int, **metrics) -> None:
        row = {"step": step, **{k: (_finite_or_none(float(v)) if hasattr(v, "__float__")
                                    and not isinstance(v, (int, bool)) else v) for k, v in metrics.items()}}
        self._f.write(json.dumps(row, allow_nan=False) + "\n")
        self._f.flush()
        if self._tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)):
                    self._tb.add_scalar(k, v, step)

    def close(self, plot: bool = True):
        self._f.close()
        if self._tb is not None:
            self._tb.close()
        return plot_metrics(self.path, os.path.join(self.output_dir, "curves.png")) if plot else None


def _finite_or_none(x: float):
    return x if math.isfinite(x) else None


def read_metrics(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def plot_metrics(jsonl: str, png: str, keys: list | None = None):
    """One panel per numeric metric against step; returns the PNG path (None without matplotlib or rows)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no curves.png")
        return None
    rows = read_metrics(jsonl)
    if not rows:
        return None
    keys = keys or [k for k in rows[0] if k != "step" and isinstance(rows[0][k], (int, float))
                    and not isinstance(rows[0][k], bool)]
    if not keys:
        return None
    cols = min(3, len(keys))
    nrows = math.ceil(len(keys) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.5 * cols, 3 * nrows), squeeze=False)
    for ax, k in zip(axes.flat, keys):
        pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float))]
        ax.plot([p[0] for p in pts], [p[1] for p in pts])
        ax.set_title(k)
        ax.set_xlabel("step")
    for ax in list(axes.flat)[len(keys):]:
        ax.axis("off")
    fig.tight_layout()
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return png
