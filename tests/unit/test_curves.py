"""Training curves: a lead page with the few curves that tell the story (GRPO: reward and its parts, TPR,
KL, decode cost; RFT: the loss on a log axis, aux loss, lr), smoothed; every other metric on a second page."""
import math

import pytest

import livemoe.train.metrics as metrics
from livemoe.train.metrics import MetricsLogger, smooth

GRPO_KEYS = ["reward/mean", "reward/std", "reward/correct/mean", "reward/correct/std", "reward/helpful/mean",
             "reward/length/mean", "reward/varied/mean", "tpr/mean", "tpr/max", "kl", "loss", "lr",
             "decode_gflops_per_response", "time/rollout_s"]


def test_grpo_lead_is_reward_parts_tpr_kl_and_decode_cost():
    panels = metrics._lead_panels(GRPO_KEYS)
    assert [p[0] for p in panels] == ["reward and its parts", "tokens per response (TPR)",
                                      "KL to the starting checkpoint", "decode cost"]
    assert panels[0][2] == ["reward/mean", "reward/correct/mean", "reward/helpful/mean", "reward/length/mean",
                            "reward/varied/mean"]  # the parts, a --reward_fns one too; no std
    assert all(p[1] for p in panels)  # every y axis labelled


def test_rft_lead_has_the_loss_on_a_log_axis():
    panels = metrics._lead_panels(["loss", "aux_loss", "lr", "grad_norm", "tokens_per_s"])
    assert panels[0][:4] == ("SFT loss", "completion loss (log scale)", ["loss"], True)
    assert [p[0] for p in panels] == ["SFT loss", "MoE load-balancing loss", "learning rate", "gradient norm"]


def test_smooth_is_a_debiased_moving_average():
    assert smooth([2.0] * 50) == pytest.approx([2.0] * 50)
    s = smooth([0.0] * 25 + [1.0] * 25)
    assert s[0] == 0.0 and 0 < s[30] < 1 and s == sorted(s)
    assert smooth([1.0, 5.0], weight=0.0) == [1.0, 5.0]


def test_two_pages_each_metric_once(tmp_path, monkeypatch):
    pages = []
    real_page = metrics._page
    monkeypatch.setattr(metrics, "_page", lambda rows, panels, png, title, cols: pages.append(
        (png, [k for p in panels for k in p[2]], panels)) or real_page(rows, panels, png, title, cols))
    log = MetricsLogger(str(tmp_path))
    for step in range(1, 31):
        log.log(step, **{k: math.sin(step) + 2 for k in GRPO_KEYS})
    assert log.close(plot=False) is None
    paths = metrics.plot_metrics(str(tmp_path / "metrics.jsonl"), str(tmp_path / "curves.png"))
    assert paths == [str(tmp_path / "curves.png"), str(tmp_path / "curves_more.png")]
    assert all((tmp_path / p).stat().st_size > 5000 for p in paths)
    lead, more = pages[0][1], pages[1][1]
    assert sorted(lead + more) == sorted(GRPO_KEYS)  # each metric drawn once
    assert "lr" in more and "kl" in lead and "loss" in more
    assert all(p[1] for p in pages[1][2])  # y labels on the second page too
