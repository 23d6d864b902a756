"""Per-step metrics: one JSON line per step (metrics.jsonl), TensorBoard if asked, PNG curves at the end
(curves.png: the lead curves of the run; curves_more.png: every other metric).

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
        if not plot:
            return None
        paths = plot_metrics(self.path, os.path.join(self.output_dir, "curves.png"))
        return paths[0] if paths else None  # the lead page (curves_more.png, when written, is beside it)


def _finite_or_none(x: float):
    return x if math.isfinite(x) else None


def read_metrics(path: str) -> list:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


# The lead page (curves.png): the few curves that tell a run's story, as panels of (title, y label,
# metric keys, log y). Curves are smoothed, with the raw values faint behind, except the lr: a schedule,
# drawn exactly. A panel shows the keys that were logged; "reward/*/mean" stands for every reward
# part (the seed's three and any --reward_fns). Every other metric goes to curves_more.png.
LEAD_GRPO = [
    ("reward and its parts", "reward (mean over rollouts)", ["reward/mean", "reward/*/mean"], False),
    ("tokens per response (TPR)", "tokens", ["tpr/mean"], False),
    ("KL to the starting checkpoint", "k3 KL per token", ["kl"], False),
    ("decode cost", "decode GFLOPs per response", ["decode_gflops_per_response"], False),
    ("rollout vs trainer (livemoe.train.mismatch)", "k3 KL; share of tokens routed differently",
     ["mismatch/k3_kl", "mismatch/routing_disagreement"], False),
]
LEAD_RFT = [
    ("SFT loss", "completion loss (log scale)", ["loss"], True),
    ("MoE load-balancing loss", "aux loss", ["aux_loss"], False),
    ("learning rate", "lr the step used", ["lr"], False),
    ("gradient norm", "norm before clipping", ["grad_norm"], False),
]


def _lead_panels(keys: list) -> list:
    """The lead panels this log has (GRPO logs `reward/mean`), with the keys present."""
    panels = []
    for title, ylabel, wanted, log in LEAD_GRPO if "reward/mean" in keys else LEAD_RFT:
        present = []
        for w in wanted:
            if "*" in w:
                head, tail = w.split("*")
                present += [k for k in keys if k.startswith(head) and k.endswith(tail) and k not in wanted
                            and k.count("/") == w.count("/")]
            elif w in keys:
                present.append(w)
        if present:
            panels.append((title, ylabel, present, log))
    return panels


def smooth(values: list, weight: float | None = None) -> list:
    """TensorBoard's debiased exponential moving average; the weight grows with the number of points."""
    if weight is None:
        weight = min(0.9, max(0.0, 1 - 10 / max(1, len(values))))
    out, avg, norm = [], 0.0, 0.0
    for v in values:
        avg, norm = weight * avg + (1 - weight) * v, weight * norm + (1 - weight)
        out.append(avg / norm)
    return out


UNSMOOTHED = ("lr",)


def _label(key: str) -> str:
    """reward/correct/mean -> correct; reward/mean -> total."""
    if key == "reward/mean":
        return "total"
    return key.removeprefix("reward/").removesuffix("/mean")


def _draw(ax, rows: list, keys: list, ylabel: str, log: bool) -> None:
    for i, k in enumerate(keys):
        pts = [(r["step"], r[k]) for r in rows if isinstance(r.get(k), (int, float)) and math.isfinite(r[k])]
        if not pts:
            continue
        steps, vals = [p[0] for p in pts], [p[1] for p in pts]
        colour = f"C{i}"
        lw = 2.0 if i == 0 and len(keys) > 1 else 1.5
        smoothed = vals if k in UNSMOOTHED else smooth(vals)
        if smoothed != vals:
            ax.plot(steps, vals, color=colour, alpha=0.25, lw=0.8)  # the raw values, faint behind
        ax.plot(steps, smoothed, color=colour, lw=lw, label=_label(k))
    if log and all(r.get(k, 1) > 0 for r in rows for k in keys if isinstance(r.get(k), (int, float))):
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.set_xlabel("step")
    ax.grid(color="0.9", lw=0.5)
    if len(keys) > 1:
        ax.legend(fontsize=8)


def _page(rows: list, panels: list, png: str, title: str, cols: int) -> str:
    import matplotlib.pyplot as plt

    cols = min(cols, len(panels))
    nrows = math.ceil(len(panels) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.4 * nrows), squeeze=False, layout="constrained")
    for ax, (name, ylabel, keys, log) in zip(axes.flat, panels):
        _draw(ax, rows, keys, ylabel, log)
        ax.set_title(name)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.savefig(png, dpi=80)
    plt.close(fig)
    return png


def plot_metrics(jsonl: str, png: str) -> list:
    """curves.png (the lead page: LEAD's panels, smoothed with the raw values faint behind) and, beside
    it, curves_more.png (every other metric). Returns the paths written ([] without matplotlib or rows)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
    except ImportError:
        print("matplotlib is not installed: no curves.png")
        return []
    rows = read_metrics(jsonl)
    keys = list(dict.fromkeys(k for r in rows for k, v in r.items()
                              if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)))
    if not keys:
        return []
    lead = _lead_panels(keys)
    shown = {k for _, _, ks, _ in lead for k in ks}
    rest = [(k, k, [k], False) for k in keys if k not in shown]
    run = os.path.basename(os.path.dirname(os.path.abspath(jsonl)))
    paths = []
    if lead:
        paths.append(_page(rows, lead, png, f"{run}: training curves (smoothed; raw values faint)", cols=2))
    if rest:
        more = png.replace(".png", "_more.png") if lead else png
        paths.append(_page(rows, rest, more, f"{run}: the other metrics", cols=4))
    return paths
