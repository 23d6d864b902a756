"""Atomic checkpoints: manifest last, temp dirs never resumed from, keep last N, RNG restored, metrics."""
import json
import os
import random

import pytest
import torch

from livemoe.engine.errors import CheckpointError
from livemoe.train.checkpoint import (is_complete, latest_checkpoint, list_checkpoints, load_checkpoint, resolve_resume,
                              save_checkpoint)
from livemoe.train.metrics import MetricsLogger, read_metrics


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


# ---------------------------------------------------------------------------------- integrity (issue 21)
@pytest.fixture
def engine_run(tmp_path):
    """A tiny engine model with an AdamW that has state, and two checkpoints of it (steps 1 and 2)."""
    from livemoe import engine
    from tiny_models import make_checkpoint

    model = engine.load_model(make_checkpoint(tmp_path / "src", moe=True)[0], device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model.lm_head_weight.sum().backward()
    opt.step()
    root = str(tmp_path / "ckpts")
    for step in (1, 2):
        save_checkpoint(root, step, model, opt, keep_last=5)
    return root, model, opt


def _overwrite(file, offset, data):
    with open(file, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_manifest_holds_sha256_of_every_file(engine_run):
    import hashlib

    root, _, _ = engine_run
    path = latest_checkpoint(root)
    files = json.load(open(os.path.join(path, "manifest.json")))["files"]
    on_disk = sorted(os.path.relpath(os.path.join(d, n), path) for d, _, ns in os.walk(path) for n in ns
                     if n != "manifest.json")
    assert sorted(files) == on_disk and "model/model.safetensors" in files
    for name, entry in files.items():
        blob = open(os.path.join(path, name), "rb").read()
        assert entry == {"size": len(blob), "sha256": hashlib.sha256(blob).hexdigest()}


def test_same_size_corruption_of_the_newest_is_skipped_with_a_line_naming_it(engine_run, capsys):
    root, _, _ = engine_run
    newest = os.path.join(root, "step-00000002")
    weights = os.path.join(newest, "model", "model.safetensors")
    size = os.path.getsize(weights)
    _overwrite(weights, size // 2, b"\xff" * 4096)  # NaN bit patterns in the tensor data, same size
    assert os.path.getsize(weights) == size and is_complete(newest)  # the old size-only check passes it
    assert resolve_resume("auto", root).endswith("step-00000001")
    out = capsys.readouterr().out
    assert f"skipping checkpoint {newest}: model/model.safetensors does not match its sha256" in out
    with pytest.raises(CheckpointError, match="model/model.safetensors does not match its sha256"):
        resolve_resume(newest, root)


def test_truncated_newest_is_skipped_with_a_line(engine_run, capsys):
    root, _, _ = engine_run
    newest = os.path.join(root, "step-00000002")
    with open(os.path.join(newest, "rng.pt"), "r+b") as f:
        f.truncate(100)
    assert resolve_resume("auto", root).endswith("step-00000001")
    assert f"skipping checkpoint {newest}: rng.pt has 100 bytes, the manifest says" in capsys.readouterr().out


def test_zeroed_optimizer_bytes_are_skipped_and_never_a_raw_traceback(engine_run, capsys):
    root, _, opt = engine_run
    newest = os.path.join(root, "step-00000002")
    file = os.path.join(newest, "optimizer.pt")
    _overwrite(file, 0, bytes(4096))  # the zip's header: unreadable
    assert resolve_resume("auto", root).endswith("step-00000001")
    assert "optimizer.pt does not match its sha256" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match=r"optimizer\.pt: cannot be loaded"):
        load_checkpoint(newest, opt)  # read anyway (a caller that skipped the check): a named error


def test_orphaned_temp_dirs_are_removed_with_a_line(tmp_path, capsys):
    m, opt, sched = make()
    save_checkpoint(str(tmp_path), 1, m, opt, sched)
    dead = tmp_path / ".tmp-step-00000002-2147483646"  # no process has this id (above pid_max)
    live = tmp_path / f".tmp-step-00000002-{os.getppid()}"  # a save still running in another process
    for d in (dead, live):
        os.makedirs(d / "model")
    capsys.readouterr()
    assert resolve_resume("auto", str(tmp_path)).endswith("step-00000001")
    assert not dead.exists() and live.exists()
    assert f"removed {dead}: left by a save that was interrupted" in capsys.readouterr().out
    os.makedirs(dead)
    save_checkpoint(str(tmp_path), 3, m, opt, sched)  # saves clean up too
    assert not dead.exists()


def test_everything_loads_with_weights_only(tmp_path, monkeypatch):
    import numpy as np

    m, opt, sched = make()
    np.random.seed(3)
    path = save_checkpoint(str(tmp_path), 1, m, opt, sched)
    want = np.random.rand(3)
    for name in ("optimizer.pt", "scheduler.pt", "rng.pt"):
        torch.load(os.path.join(path, name), weights_only=True)  # raises on anything but tensors and plain data
    calls = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **kw: calls.append(kw.get("weights_only")) or real_load(*a, **kw))
    np.random.seed(99)
    load_checkpoint(path, opt, sched)
    assert calls == [True, True, True]
    assert np.array_equal(np.random.rand(3), want)  # numpy's RNG restored from tensors


def test_nonfinite_weights_are_never_saved_and_keep_last_keeps_the_good_ones(tmp_path):
    m, opt, sched = make()
    for step in (1, 2):
        save_checkpoint(str(tmp_path), step, m, opt, sched, keep_last=2)
    with torch.no_grad():
        m.lin.bias[1] = float("nan")
    with pytest.raises(CheckpointError, match=r"not saving checkpoint step 3: 'lin.bias' holds NaN or Inf"):
        save_checkpoint(str(tmp_path), 3, m, opt, sched, keep_last=2)
    assert sorted(os.listdir(tmp_path)) == ["step-00000001", "step-00000002"]  # nothing rotated, no temp dir
    with torch.no_grad():
        m.lin.bias[1] = 0.0
    opt.state[m.lin.weight]["exp_avg"][0, 0] = float("inf")  # a poisoned optimizer is not saved either
    with pytest.raises(CheckpointError, match="optimizer state exp_avg"):
        save_checkpoint(str(tmp_path), 3, m, opt, sched, keep_last=2)


def test_metrics_never_write_bare_nan(tmp_path):
    log = MetricsLogger(str(tmp_path))
    log.log(1, loss=torch.tensor(float("nan")), grad_norm=float("inf"), lr=0.1)
    log.close(plot=False)
    line = (tmp_path / "metrics.jsonl").read_text()
    row = json.loads(line, parse_constant=lambda c: pytest.fail(f"non-JSON constant {c} in {line}"))
    assert row == {"step": 1, "loss": None, "grad_norm": None, "lr": 0.1}


def test_checkpoint_files_get_the_umask_permissions(tmp_path):
    from livemoe import engine
    from tiny_models import make_checkpoint

    model = engine.load_model(make_checkpoint(tmp_path / "src", moe=False)[0], device="cpu")
    old = os.umask(0o022)
    try:
        path = save_checkpoint(str(tmp_path / "ckpts"), 1, model)
    finally:
        os.umask(old)
    modes = {os.path.relpath(os.path.join(d, n), path): os.stat(os.path.join(d, n)).st_mode & 0o777
             for d, dirs, files in os.walk(path) for n in dirs + files}
    assert {"model", "model/model.safetensors", "rng.pt", "manifest.json"} <= set(modes)
    assert os.stat(path).st_mode & 0o777 == 0o755
    assert modes == {p: 0o755 if os.path.isdir(os.path.join(path, p)) else 0o644 for p in modes}


@pytest.mark.parametrize("fault", [OSError(28, "No space left on device"),
                                   RuntimeError("[enforce fail at inline_container.cc:626] . unexpected pos 64 vs 0"
                                                ": PytorchStreamWriter failed writing file data/0: file write failed")])
def test_disk_full_is_one_line_the_previous_checkpoint_survives(tmp_path, monkeypatch, fault):
    """ENOSPC (raw, or wrapped by torch's zip writer) while saving: one CheckpointError line naming the path and
    the free space; the previous checkpoint stays complete and the temp dir is removed."""
    import livemoe.train.checkpoint as ckpt

    m, opt, sched = make()
    first = save_checkpoint(str(tmp_path), 1, m, opt, sched)
    real = torch.save

    def full(obj, f, *a, **k):
        if str(f).endswith("optimizer.pt"):
            raise fault
        return real(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", full)
    with pytest.raises(CheckpointError) as e:
        save_checkpoint(str(tmp_path), 2, m, opt, sched)
    msg = str(e.value)
    assert "\n" not in msg and "no space left on device" in msg and str(tmp_path) in msg and "MiB free" in msg
    assert list_checkpoints(str(tmp_path)) == [first] and is_complete(first)
    assert sorted(os.listdir(tmp_path)) == ["step-00000001"]  # no temp dir left
    monkeypatch.setattr(ckpt.torch, "save", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("other")))
    with pytest.raises(RuntimeError, match="other"):  # any other failure is raised as it is, the temp dir removed
        save_checkpoint(str(tmp_path), 2, m, opt, sched)
    assert sorted(os.listdir(tmp_path)) == ["step-00000001"]
