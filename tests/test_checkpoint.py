"""Atomic checkpoints: manifest last, temp dirs never resumed from, keep last N, RNG restored, metrics."""
import json
import os
import random

import pytest
import torch

from train.checkpoint import (is_complete, latest_checkpoint, list_checkpoints, load_checkpoint, resolve_resume,
                              save_checkpoint)
from train.metrics import MetricsLogger, read_metrics


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(3, 2)

    def save_pretrained(self, path):
        os.makedirs(path, exist_ok=True)
        torch.save(self.state_dict(), os.path.join(path, "w.pt"))


def make():
    torch.manual_seed(0)
    m = Tiny()
    opt = torch.optim.AdamW(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    m.lin.weight.sum().backward()
    opt.step(), sched.step()
    return m, opt, sched


def test_save_load_round_trip_and_rng(tmp_path):
    m, opt, sched = make()
    random.seed(5)
    torch.manual_seed(5)
    path = save_checkpoint(str(tmp_path), 3, m, opt, sched, {"data_position": 17})
    want = (random.random(), torch.rand(2))
    assert os.path.basename(path) == "step-00000003" and is_complete(path)
    manifest = json.load(open(os.path.join(path, "manifest.json")))
    assert set(manifest["files"]) >= {"model/w.pt", "optimizer.pt", "scheduler.pt", "rng.pt", "trainer_state.json"}
    m2, opt2, sched2 = make()
    opt2.state.clear()
    state = load_checkpoint(path, opt2, sched2)
    assert state == {"step": 3, "data_position": 17}
    assert (random.random(), torch.rand(2))[0] == want[0]
    assert sched2.state_dict()["last_epoch"] == sched.state_dict()["last_epoch"]
    assert torch.equal(opt2.state_dict()["state"][0]["exp_avg"], opt.state_dict()["state"][0]["exp_avg"])


def test_keep_last_and_latest(tmp_path):
    m, opt, sched = make()
    for step in (1, 2, 3, 4):
        save_checkpoint(str(tmp_path), step, m, opt, sched, keep_last=2)
    assert [os.path.basename(p) for p in list_checkpoints(str(tmp_path))] == ["step-00000003", "step-00000004"]
    assert latest_checkpoint(str(tmp_path)).endswith("step-00000004")


def test_incomplete_checkpoints_are_never_resumed(tmp_path):
    m, opt, sched = make()
    save_checkpoint(str(tmp_path), 1, m, opt, sched)
    # a crash mid-write leaves a temp dir; a torn copy lacks its manifest or has a short file
    os.makedirs(tmp_path / ".tmp-step-00000002-99" / "model")
    broken = tmp_path / "step-00000005"
    os.makedirs(broken)
    (broken / "trainer_state.json").write_text("{}")
    short = save_checkpoint(str(tmp_path / "other"), 7, m, opt, sched)
    with open(os.path.join(short, "optimizer.pt"), "r+b") as f:
        f.truncate(10)
    assert not is_complete(short)
    assert resolve_resume("auto", str(tmp_path)).endswith("step-00000001")
    assert resolve_resume("auto", str(tmp_path / "empty")) is None
    assert resolve_resume("none", str(tmp_path)) is None
    with pytest.raises(ValueError, match="not a valid checkpoint: no manifest.json"):
        resolve_resume(str(broken), str(tmp_path))


def test_metrics_jsonl_png_and_resume_truncation(tmp_path):
    log = MetricsLogger(str(tmp_path))
    for s in range(1, 6):
        log.log(s, loss=torch.tensor(1.0 / s), lr=0.1, note="x")
    png = log.close()
    assert png and os.path.getsize(png) > 1000
    rows = read_metrics(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5] and rows[1]["loss"] == 0.5
    log = MetricsLogger(str(tmp_path), resume_step=3)  # resumed from step 3: 4 and 5 are redone
    log.log(4, loss=9.0, lr=0.1)
    log.close(plot=False)
    assert [(r["step"], r["loss"]) for r in read_metrics(str(tmp_path / "metrics.jsonl"))][-2:] == [(3, pytest.approx(1 / 3)), (4, 9.0)]
