"""bench/out/results.png: one panel per suite and kind, log ratio axis with 1x marked, slower rows visible,
overhead and reproduction rows drawn as what they are; results.md says the same in words."""
import pytest

from bench import common
from bench.common import Row
from bench.plot import draw_results

ROWS = [
    Row(suite="moe", case="fwd T=64", metric="ms", ours=1.0, baseline=4.0, baseline_name="per-expert loop"),
    Row(suite="moe", case="fwd T=64", metric="ms", ours=1.0, baseline=0.5, baseline_name="grouped_mm"),
    Row(suite="moe", case="fwd T=512", metric="ms", ours=2.0, baseline=200.0, baseline_name="per-expert loop"),
    Row(suite="serve", case="TTFT p50", metric="ms", ours=8.0, baseline=2.0, baseline_name="AsyncLLM direct",
        kind="overhead"),
    Row(suite="serve", case="throughput", metric="tok/s", ours=900.0, baseline=1000.0, baseline_name="AsyncLLM direct",
        higher_is_better=True, kind="overhead"),
    Row(suite="decode cost", case="qwen3-32b", metric="D. TFLOPs", ours=23.54, baseline=23.55,
        baseline_name="seed Table 3", kind="reproduction"),
    Row(suite="decode cost", case="tiny MoE", metric="TPR", ours=62.9),
]


def _texts(ax) -> list:
    return [t.get_text() for t in ax.texts]


def test_one_panel_per_suite_and_kind():
    fig = draw_results(ROWS, "title")
    axes = {ax.get_title(loc="left"): ax for ax in fig.axes}
    assert len(axes) == 3
    moe = next(ax for t, ax in axes.items() if t.startswith("moe"))
    serve = next(ax for t, ax in axes.items() if t.startswith("serve"))
    repro = next(ax for t, ax in axes.items() if t.startswith("decode cost"))
    assert "overhead" in serve.get_title(loc="left") and "reproduced" in repro.get_title(loc="left")
    assert "1 rows without a baseline" in fig._suptitle.get_text()

    # ratios on a log axis with 1x marked; each row's bar starts at 1x, a slower one goes left of it
    assert moe.get_xscale() == "log" and serve.get_xscale() == "log" and repro.get_xscale() == "linear"
    assert any(list(line.get_xdata()) == [1.0, 1.0] for line in moe.lines)
    bars = sorted((p.get_x() + p.get_width()) for p in moe.patches if p.get_height() > 0)
    assert len(bars) == 3
    assert bars == pytest.approx([0.5, 4.0, 100.0])
    assert "2.00x slower" in _texts(moe) and "4.00x" in _texts(moe) and "100.00x" in _texts(moe)
    assert moe.get_xlim()[0] < 0.5 < 100 < moe.get_xlim()[1]
    # each bar's baseline is named (legend), the case on the y axis
    assert [t.get_text() for t in moe.get_legend().get_texts()] == ["vs per-expert loop", "vs grouped_mm"]
    assert [t.get_text() for t in moe.get_yticklabels()] == ["fwd T=64", "fwd T=512"]

    # the server's cost against direct calls reads as overhead, not as "better by"
    assert _texts(serve) == ["+300%", "+11%"]
    # the reproduction row: ours / published, near 1
    assert any("-0.0%" in t for t in _texts(repro))


def test_results_md_reads_each_kind(tmp_path, monkeypatch):
    monkeypatch.setattr(common, "OUT_DIR", str(tmp_path))
    monkeypatch.setattr(common, "ROWS", list(ROWS))
    paths = common.write_results("quick")
    assert [p.rsplit("/", 1)[1] for p in paths] == ["results.json", "results.md", "results.png"]
    md = (tmp_path / "results.md").read_text()
    assert "| 4.00x better |" in md and "| 2.00x worse |" in md
    assert "| +300% cost |" in md and "| +11% cost |" in md
    assert "| 1.000 of it (-0.0%) |" in md
    assert (tmp_path / "results.png").stat().st_size > 10_000
