"""Sharded checkpoints (livemoe.train.checkpoint.save_sharded_checkpoint) on 2 gloo ranks with expert_parallel 2: the
weights and AdamW states load back into one process (resharded: the EP ranks' expert slices joined) equal to
what the ranks held; a rank killed during a save leaves the previous checkpoint the newest valid one, and the
killed save's temp dir is removed by the next resume. (Resuming livemoe.train.rft with 1 and 4 ranks from a 2-rank save:
test_parallel_rft.py.)"""
import os

import pytest
import torch

from spawn_ranks import spawn_ranks
from test_parallel_fsdp import BATCH, batch, build_model, loss_sum

from livemoe.engine.errors import CheckpointError


def _one_step(model, opt, rows, step):
    ids, mask = batch(step)
    (loss_sum(model, ids[rows], mask[rows]) / mask.sum()).backward()
    opt.step()
    opt.zero_grad()


def _optimizer_by_name(model, opt) -> dict:
    """{parameter name: (exp_avg, exp_avg_sq)} (this rank's shard; whole in one process)."""
    local = lambda t: t.to_local() if hasattr(t, "to_local") else t  # noqa: E731
    return {name: tuple(local(opt.state[p][k]).clone() for k in ("exp_avg", "exp_avg_sq"))
            for name, p in model.named_parameters()}


def save_worker(root: str, kill_rank: int | None):
    from livemoe.train import checkpoint
    from livemoe.train.distributed import setup

    d = setup(expert_parallel=2, timeout_s=20, num_experts=4)
    model = d.parallelize(build_model(), bf16=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    rows = slice(d.rank * BATCH // 2, (d.rank + 1) * BATCH // 2)
    _one_step(model, opt, rows, 0)
    sched.step()
    path = d.save_checkpoint(root, 1, model, opt, sched, {"data_position": 4}, keep_last=2)
    out = {"path": path, "weights": d.full_state_dict(model), "optimizer": _optimizer_by_name(model, opt),
           "ep_rank": d.mesh.ep.get_local_rank()}
    if kill_rank is None:
        return out
    _one_step(model, opt, rows, 1)
    if d.rank == kill_rank:  # dies after writing its shards, before the manifest
        checkpoint.file_digests = lambda *a: os._exit(3)
    try:
        d.save_checkpoint(root, 2, model, opt, sched, {"data_position": 8}, keep_last=2)
    except Exception as e:  # noqa: BLE001  (the surviving rank's collective fails: reported to the test)
        torch.save({**out, "error": f"{type(e).__name__}: {e}"}, os.path.join(root, "survivor.pt"))
        return out
    raise AssertionError("the save went through although a rank died")


def _load_one_process(path):
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # noqa: F401  (DCP in one process)

    from livemoe.train.checkpoint import load_checkpoint

    model = build_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # every weight must come from the checkpoint
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    state = load_checkpoint(path, opt, sched, model=model)
    return model, opt, sched, state


@pytest.mark.slow
def test_two_rank_save_loads_into_one_process(tmp_path):
    from livemoe.train.checkpoint import load_checkpoint

    root = str(tmp_path / "checkpoints")
    results = spawn_ranks(save_worker, 2, root, None, timeout=180)
    path = results[0]["path"]
    assert [r["path"] for r in results] == [path, path] and path.endswith("step-00000001")
    assert os.path.isfile(os.path.join(path, "manifest.json")) and os.path.isdir(os.path.join(path, "dcp"))
    model, opt, sched, state = _load_one_process(path)
    assert state == {"step": 1, "data_position": 4, "world_size": 2}
    assert sched.last_epoch == 1 and opt.param_groups[0]["lr"] == pytest.approx(1e-3 / 2)
    want = results[0]["weights"]
    got = dict(model.named_parameters())
    assert got.keys() == want.keys() and len(want) > 0
    for name, t in want.items():
        assert torch.equal(got[name].detach(), t), name
    # AdamW states: dense ones are FSDP shards over both ranks (rows split in rank order); experts: each EP rank's
    # slice of the experts (dp_mod_ep = 1, so whole on that rank)
    loaded = _optimizer_by_name(model, opt)
    by_ep = sorted(results, key=lambda r: r["ep_rank"])
    for name in want:
        for i in range(2):
            shards = [r["optimizer"][name][i] for r in (by_ep if ".mlp.experts." in name else results)]
            assert torch.equal(loaded[name][i], torch.cat(shards)), name
        assert loaded[name][1].abs().sum() > 0, name  # a state that training wrote, not a fresh zero

    from livemoe.engine.model.config import ModelConfig
    from livemoe.engine.model.qwen3 import Qwen3ForCausalLM
    from test_parallel_fsdp import CFG

    other = Qwen3ForCausalLM(ModelConfig.from_dict({**CFG, "hidden_size": 48}))
    with pytest.raises(CheckpointError, match=r"dcp: does not fit this model and optimizer \(a checkpoint of another "
                                              r"model\?\): .*Size mismatch .*\[61, 32\].*\[61, 48\]"):
        load_checkpoint(path, torch.optim.AdamW(other.parameters()), model=other)


@pytest.mark.slow
def test_rank_killed_during_a_save_leaves_the_previous_checkpoint(tmp_path):
    from livemoe.train.checkpoint import check_checkpoint, latest_checkpoint, resolve_resume

    root = str(tmp_path / "checkpoints")
    with pytest.raises(RuntimeError, match="rank 1 exited with code 3"):
        spawn_ranks(save_worker, 2, root, 1, timeout=180)
    survivor = torch.load(os.path.join(root, "survivor.pt"), weights_only=False)
    assert survivor["error"]  # rank 0 did not hang: its collective failed when rank 1 died
    names = sorted(os.listdir(root))
    assert names[0].startswith(".tmp-step-00000002-") and names[1:] == ["step-00000001", "survivor.pt"]
    assert latest_checkpoint(root) == os.path.join(root, "step-00000001")
    assert check_checkpoint(os.path.join(root, "step-00000001")) is None
    assert resolve_resume("auto", root) == os.path.join(root, "step-00000001")
    assert not any(n.startswith(".tmp-") for n in os.listdir(root))  # the dead save's temp dir is removed
    model, _, _, state = _load_one_process(os.path.join(root, "step-00000001"))
    assert state["step"] == 1
    for name, p in model.named_parameters():
        assert torch.equal(p.detach(), survivor["weights"][name]), name


def test_a_one_process_checkpoint_is_refused_under_torchrun(tmp_path):
    """Its optimizer.pt is indexed by the whole parameters; the sharded optimizer cannot take it."""
    from types import SimpleNamespace

    from livemoe.train.checkpoint import load_checkpoint, save_checkpoint

    model = build_model()
    opt = torch.optim.AdamW(model.parameters())
    path = save_checkpoint(str(tmp_path), 1, model, opt)
    with pytest.raises(CheckpointError, match=r"step-00000001: written by one process \(optimizer.pt\); under "
                                              r"torchrun resume from a checkpoint written under torchrun"):
        load_checkpoint(path, opt, model=model, comm=SimpleNamespace(world_size=2))
    assert load_checkpoint(path, opt, model=model)["step"] == 1  # in one process it loads
