"""results.png: the benchmark rows drawn so that a person reads them at a glance.

One panel per suite and kind of row, in two columns:
- "speedup" rows (ours against a baseline): a log-scale ratio axis with 1x marked, a bar from 1x to the
  ratio, one colour per baseline (named in the panel's legend); a row slower than its baseline is a
  hatched bar left of 1x, labelled "N.Nx slower";
- "overhead" rows (a layer against the same work without it, e.g. the HTTP server against AsyncLLM
  called directly): the cost ratio on a log axis, labelled "+N%";
- "reproduction" rows (our figure against a published one): ours / published on a linear axis around
  1, with the +-3% band the tests hold it to.
Rows without a baseline (absolute figures) are only in results.md; the figure says how many.
"""
import textwrap
from collections import OrderedDict

KINDS = ("speedup", "overhead", "reproduction")
BAR_IN = 0.2      # inches of figure height per bar
CASE_GAP_IN = 0.08  # extra space between cases
PANEL_IN = 1.0    # title, ticks and axis label of a panel
SAME = 0.02       # ratios within 2% of 1 read as "same"


def _panels(rows) -> "OrderedDict":
    """(suite, kind) -> rows with a baseline, in the order first recorded."""
    panels = OrderedDict()
    for r in rows:
        if r.baseline is None or r.speedup is None:
            continue
        panels.setdefault((r.suite, r.kind), []).append(r)
    return panels


def _cases(rows) -> "OrderedDict":
    """(case, metric) -> rows (one per baseline), in order."""
    cases = OrderedDict()
    for r in rows:
        cases.setdefault((r.case, r.metric), []).append(r)
    return cases


def _height(rows, kind: str) -> float:
    legend = 0.2 + 0.17 * len({r.baseline_name for r in rows}) if kind == "speedup" else 0.0
    return PANEL_IN + max(0.6, BAR_IN * len(rows) + CASE_GAP_IN * len(_cases(rows))) + legend


def _panel_title(suite: str, kind: str, rows) -> str:
    metrics = sorted({r.metric for r in rows})
    unit = f" ({metrics[0]})" if len(metrics) == 1 else ""
    if kind == "overhead":
        return f"{suite}{unit}: overhead against {rows[0].baseline_name} (1x = none)"
    if kind == "reproduction":
        return f"{suite}{unit}: reproduced, ours / {rows[0].baseline_name}"
    return f"{suite}{unit}: ours vs baselines"


def _ratio_ticks(ax, lo: float, hi: float) -> None:
    from matplotlib.ticker import FixedLocator, NullLocator

    ticks = [t for t in (0.1, 0.2, 0.5, 1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if lo <= t <= hi]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{t:g}x" for t in ticks])


def _bars(ax, rows, kind: str) -> None:
    """Horizontal bars from 1x to each row's ratio, grouped by case; ratio = speedup, or cost ratio."""
    import matplotlib.pyplot as plt
    from matplotlib.transforms import ScaledTranslation

    cases = _cases(rows)
    single_metric = len({m for _, m in cases}) == 1
    names = list(OrderedDict.fromkeys(r.baseline_name for r in rows))
    colours = dict(zip(names, plt.get_cmap("tab10").colors)) if kind == "speedup" else {n: "tab:orange" for n in names}
    y, ticks, labels, ratios = 0.0, [], [], []
    for (case, metric), group in cases.items():
        top = y
        for r in group:
            ratio = r.speedup if kind == "speedup" else 1.0 / r.speedup
            ratios.append(ratio)
            same = abs(ratio - 1) < SAME
            worse = kind == "speedup" and ratio < 1 and not same
            ax.barh(y, ratio - 1.0, left=1.0, height=0.8, color=colours[r.baseline_name],
                    hatch="////" if worse else None, edgecolor="black" if worse else "none", linewidth=0.4,
                    label=r.baseline_name)
            if kind == "speedup":
                text = f"{1 / ratio:.2f}x slower" if worse else (f"same ({ratio:.2f}x)" if same else f"{ratio:.2f}x")
            else:
                text = f"{100 * (ratio - 1):+.0f}%"
            ax.text(ratio * (0.97 if ratio < 1 else 1.03), y, text, va="center", ha="right" if ratio < 1 else "left",
                    fontsize=7, color="darkred" if worse else "black")
            y += 1.0
        ticks.append((top + y - 1.0) / 2)
        labels.append(case if single_metric else f"{case} [{metric}]")
        y += CASE_GAP_IN / BAR_IN
    ax.set_xscale("log")
    lo, hi = min(ratios + [1.0]), max(ratios + [1.0])
    lo, hi = lo / 2.2, hi * 2.2  # room for the value labels
    ax.set_xlim(lo, hi)
    _ratio_ticks(ax, lo, hi)
    ax.axvline(1.0, color="black", lw=1.0)
    ax.set_yticks(ticks)
    ax.set_yticklabels(labels, fontsize=7)
    ax.set_ylim(y - CASE_GAP_IN / BAR_IN, -0.8)
    ax.grid(axis="x", color="0.85", lw=0.5)
    ax.set_axisbelow(True)
    if kind == "speedup":
        ax.set_xlabel("ours better than the baseline by (x, log scale); left of 1x: slower", fontsize=8)
        seen = OrderedDict()
        for h, lab in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(lab, h)  # the first bar of each baseline (a later one may be hatched)
        # below the axis and its label (half an inch), so it never hides a bar
        below = ax.transAxes + ScaledTranslation(0, -0.5, ax.figure.dpi_scale_trans)
        ax.legend(list(seen.values()), [f"vs {lab}" for lab in seen], fontsize=7, loc="upper left",
                  bbox_to_anchor=(0.0, 0.0), bbox_transform=below, frameon=False)
    else:
        ax.set_xlabel("cost with the layer / without it (time, or 1 / throughput; log scale)", fontsize=8)


def _reproduction(ax, rows, tolerance: float = 0.03) -> None:
    ratios = [r.ours / r.baseline for r in rows]
    ys = list(range(len(rows)))
    ax.axvspan(1 - tolerance, 1 + tolerance, color="tab:green", alpha=0.12, lw=0, label=f"within {tolerance:.0%}")
    ax.axvline(1.0, color="black", lw=1.0)
    ax.plot(ratios, ys, "o", color="tab:green")
    for y, r, ratio in zip(ys, rows, ratios):
        ax.text(ratio, y - 0.3, f"ours {r.ours:.4g} vs {r.baseline:.4g} ({100 * (ratio - 1):+.1f}%)", ha="center",
                va="bottom", fontsize=7)
    span = max([tolerance * 2] + [abs(x - 1) * 1.5 for x in ratios])
    ax.set_xlim(1 - span, 1 + span)
    ax.set_yticks(ys)
    ax.set_yticklabels([f"{r.case} [{r.metric}]" for r in rows], fontsize=7)
    ax.set_ylim(len(rows) - 0.4, -0.9)
    ax.set_xlabel(f"ours / {rows[0].baseline_name} (linear)", fontsize=8)
    ax.legend(fontsize=7, loc="lower right")


def draw_results(rows, title: str):
    """The figure of `rows` (bench.common.Row); returns the matplotlib Figure (the caller saves it)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = _panels(rows)
    if not panels:
        return None
    # two columns, each panel to the shorter one, in order
    columns, heights = ([], []), [0.0, 0.0]
    for key, group in panels.items():
        c = 0 if heights[0] <= heights[1] else 1
        columns[c].append((key, group))
        heights[c] += _height(group, key[1])
    tallest = max(heights)
    fig = plt.figure(figsize=(17 if columns[1] else 9, tallest + 0.8), layout="constrained")
    outer = fig.add_gridspec(1, 2 if columns[1] else 1)
    for c, col in enumerate(columns):
        if not col:
            continue
        spacer = [tallest - heights[c]] if tallest - heights[c] > 0.05 else []  # the shorter column's empty foot
        ratios = [_height(g, k[1]) for k, g in col] + spacer
        inner = outer[0, c].subgridspec(len(ratios), 1, height_ratios=ratios)
        for i, ((suite, kind), group) in enumerate(col):
            ax = fig.add_subplot(inner[i, 0])
            if kind == "reproduction":
                _reproduction(ax, group)
            else:
                _bars(ax, group, kind)
            ax.set_title(textwrap.fill(_panel_title(suite, kind, group), 70), fontsize=9, loc="left",
                         fontweight="bold")
    absolute = sum(1 for r in rows if r.baseline is None or r.speedup is None)
    note = f"; {absolute} rows without a baseline (absolute figures) are in results.md" if absolute else ""
    fig.suptitle(title + note, fontsize=11)
    return fig
