"""`torchrun --nproc_per_node 2 -m train.rft` (gloo, CPU), with and without --expert_parallel 2, against the
same run in one process: the per-step losses, load-balancing losses and gradient norms, and the exported final
weights. Also the bad-input refusals under torchrun, on every rank before any work (the mesh's own errors on every
rank are tested in test_parallel_ep.py; here the trainer's own refusals).

Tolerance (fp32): losses and gradient norms rtol 1e-5 (seen 1.2e-7); weights atol 5e-5 after 2 AdamW steps at
lr 1e-2 (seen 3e-6 without EP, 6e-6 with): the ranks sum the same terms in other groupings, and Adam's division
by sqrt(v) turns a rounding of a tiny gradient into a small fraction of lr; a missing rank's share or an
averaged reduction moves weights by ~lr, 200x the tolerance."""
import json
import os
import shutil
import subprocess
import sys

import pytest
import torch

from spawn_ranks import free_port
from test_rft import student, tiny_cfg  # noqa: F401  (the module's tiny student checkpoint fixture)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# rehearsal 0 unless a test says otherwise: its batch sizes count the selected examples
ARGS = dict(train_rooms=12, k=2, max_steps=2, batch_size=4, eval_rooms=0, warmup_steps=1, lr=1e-2, device="cpu",
            progress=False, rehearsal=0)


def torchrun(nproc: int, out: str, model: str, *extra: str, timeout: float = 300, **args) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), "-m", "livemoe.train.rft", "--model", model, "--output_dir", out]
    for k, v in {**ARGS, **args}.items():
        cmd += [f"--{k}", str(v).lower() if isinstance(v, bool) else str(v)]
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return subprocess.run(cmd + list(extra), cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def metrics(out) -> list:
    return [json.loads(x) for x in open(os.path.join(out, "metrics.jsonl")).read().splitlines()]


@pytest.mark.slow
def test_torchrun_two_ranks_equal_one_process(student, tmp_path):  # noqa: F811
    from livemoe import engine
    from livemoe.train.rft.trainer import run

    one = tmp_path / "one"
    run(tiny_cfg(student, one, **ARGS))
    ref_rows, ref = metrics(one), engine.load_model(str(one / "final"), dtype=torch.float32)
    start = engine.load_model(student, dtype=torch.float32)
    for ep in (1, 2):
        out = str(tmp_path / f"ep{ep}")
        res = torchrun(2, out, student, "--expert_parallel", str(ep))
        assert res.returncode == 0, res.stderr[-3000:]
        assert res.stdout.count("resolved config") == 1  # rank 0 alone prints
        rows = metrics(out)
        assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2]
        for key in ("loss", "aux_loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor([r[key] for r in rows]), torch.tensor([r[key] for r in ref_rows]),
                                       rtol=1e-5, atol=0, msg=f"{key}, expert_parallel {ep}")
        assert [r["tokens"] for r in rows] == [r["tokens"] for r in ref_rows]
        assert json.load(open(os.path.join(out, "parallel.json"))) == {
            "world_size": 2, "expert_parallel": ep, "data_parallel": 2, "expert_data_parallel": 2 // ep}
        got = engine.load_model(os.path.join(out, "final"), dtype=torch.float32).state_dict()
        assert got.keys() == ref.state_dict().keys()
        for name, t in ref.state_dict().items():
            torch.testing.assert_close(got[name], t, rtol=0, atol=5e-5, msg=f"{name}, expert_parallel {ep}")
    moved = [not torch.equal(a, b) for a, b in zip(start.parameters(), ref.parameters())]
    assert sum(moved) >= len(moved) - 1  # training moved the weights: the match is not of the initial ones


@pytest.mark.slow
def test_save_with_two_ranks_resume_with_one_and_four(student, tmp_path):  # noqa: F811
    """Sharded checkpoints: a 2-rank run (expert_parallel 2) "crashes" after step 2; resuming it with 1 process
    and with 4 ranks (expert_parallel 2: each expert sharded over 2 ranks) gives the uninterrupted run's losses
    and final weights (the tolerances above: the ranks sum in other groupings)."""
    from livemoe import engine
    from livemoe.train.rft.trainer import run

    # 10 selected examples and 5 rehearsal conversations (built alike on every rank): 3 whole batches an epoch
    args = dict(max_steps=4, save_every=2, keep_last=5, batch_size=5, rehearsal=0.5)
    one = tmp_path / "one"
    run(tiny_cfg(student, one, **{**ARGS, **args}))
    ref_rows, ref = metrics(one), engine.load_model(str(one / "final"), dtype=torch.float32)
    out = tmp_path / "two"
    res = torchrun(2, str(out), student, "--expert_parallel", "2", **args)
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(os.listdir(out / "checkpoints")) == ["step-00000002", "step-00000004"]
    assert os.path.isdir(out / "checkpoints" / "step-00000002" / "dcp")  # sharded, not a gathered model/

    def crash_after_step_2():
        shutil.rmtree(out / "checkpoints" / "step-00000004")
        shutil.rmtree(out / "final")

    for resume in ("one process", "4 ranks"):
        crash_after_step_2()
        if resume == "one process":
            run(tiny_cfg(student, out, **{**ARGS, **args}, resume="auto"))
        else:
            res = torchrun(4, str(out), student, "--expert_parallel", "2", "--resume", "auto", **args)
            assert res.returncode == 0, res.stderr[-3000:]
            assert "resumed from" in res.stdout and "step 2" in res.stdout
        rows = metrics(out)
        assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2, 3, 4]
        for key in ("loss", "grad_norm"):
            torch.testing.assert_close(torch.tensor([r[key] for r in rows]), torch.tensor([r[key] for r in ref_rows]),
                                       rtol=1e-5, atol=0, msg=f"{key}, resumed with {resume}")
        got = engine.load_model(str(out / "final"), dtype=torch.float32).state_dict()
        assert got.keys() == ref.state_dict().keys() and len(got) > 0
        for name, t in ref.state_dict().items():
            torch.testing.assert_close(got[name], t, rtol=0, atol=5e-5, msg=f"{name}, resumed with {resume}")


@pytest.mark.parametrize("extra, message", [
    (["--batch_size", "1"], "--batch_size 1 (the global batch) is smaller than the world size 2"),
])
@pytest.mark.slow
def test_torchrun_bad_input_fails_on_every_rank(student, tmp_path, extra, message):  # noqa: F811
    res = torchrun(2, str(tmp_path / "o"), student, *extra, timeout=120)
    assert res.returncode != 0
    assert res.stderr.count(message) >= 2, res.stderr[-3000:]  # each rank says it
