"""`torchrun --nproc_per_node 2 -m train.grpo` (gloo, CPU), with and without --expert_parallel 2, against the same
run in one process with the same global batch: the per-step losses, gradient norms and rewards, and the exported
final weights; the 2-rank expert-parallel run's sharded checkpoint resumed in one process gives them too. Each rank
generates the rollouts of its prompts (seeded by their places in the global batch) with a
gathered inference copy of the sharded policy; the reference model is sharded like the policy.

Tolerance (fp32): losses, KL and gradient norms rtol 1e-5; rewards and lengths equal (the ranks sample the same
tokens); weights atol 2e-4 after 2 AdamW steps at lr 1e-2 (seen 1e-4 on 7 of 196k elements, all expert weights that
few tokens reach, 4e-5 elsewhere): the ranks sum the same terms in other groupings, and where a gradient element is
near AdamW's eps (1e-8) its first updates, g / (|g| + eps) * lr, turn that rounding into a visible fraction of lr.
A missing rank's share or a wrongly normalised loss moves weights by ~lr (1e-2), 50x the tolerance."""
import os
import shutil
import subprocess
import sys

import pytest
import torch

from spawn_ranks import free_port
from test_grpo import args, multi_turn_records
from test_rollout import make_student

from livemoe.train.config import parse_config
from livemoe.train.data import write_jsonl
from livemoe.train.grpo.__main__ import main
from livemoe.train.grpo.config import GRPOConfig
from livemoe.train.grpo.trainer import GRPOTrainer
from livemoe.train.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REWARD = ["--reward_fns", "test_precision:varied"]  # importable by the torchrun ranks (tests/unit/ on their path)


def torchrun_grpo(nproc: int, argv: list, timeout: float = 300) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), "-m", "livemoe.train.grpo", *argv]
    path = [ROOT, os.path.join(ROOT, "tests"), os.path.join(ROOT, "tests", "unit")]  # test_precision is in tests/unit
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path), OMP_NUM_THREADS="1")
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return make_student(tmp_path_factory.mktemp("student") / "ckpt")


@pytest.mark.slow
def test_two_ranks_equal_one_process(student, tmp_path):
    from livemoe import engine

    one = tmp_path / "one"
    assert main(args(student, one, *REWARD, "--device", "cpu", "--rollout_is", "none")) == 0
    ref_rows = read_metrics(str(one / "metrics.jsonl"))
    ref = engine.load_model(str(one / "final"), dtype=torch.float32).state_dict()
    for ep in (1, 2):
        out = tmp_path / f"ep{ep}"
        # --rollout_is none as in the reference: the TIS weight exp(logp_trainer - logp_rollout) carries the ranks'
        # ~1e-6 reduction-order differences into every gradient, which the near-eps AdamW effect above turns into
        # weight differences past 2e-4 (seen 2.5e-4 on 1 of 189k elements after 2 steps; losses equal to 2e-6
        # relative, as in the R3 test below)
        flags = [*REWARD, "--device", "cpu", "--expert_parallel", str(ep), "--save_every", "1", "--keep_last", "5",
                 "--rollout_is", "none"]
        res = torchrun_grpo(2, args(student, out, *flags))
        assert res.returncode == 0, res.stderr[-3000:]
        assert os.path.isdir(out / "checkpoints" / "step-00000001" / "dcp")  # sharded
        runs = ["2 ranks"]
        if ep == 2:  # "crash" after step 1, resume the 2-rank expert-parallel checkpoint in one process
            shutil.rmtree(out / "checkpoints" / "step-00000002")
            shutil.rmtree(out / "final")
            trainer = GRPOTrainer(parse_config(GRPOConfig, args(student, out, *REWARD, "--device", "cpu", "--resume",
                                                                "auto", "--rollout_is", "none")))
            assert trainer.resume_from.endswith("step-00000001") and trainer.step == 1  # really continues
            trainer.train()
            runs.append("resumed in one process")
        rows = read_metrics(str(out / "metrics.jsonl"))
        what = f"expert_parallel {ep}, {' then '.join(runs)}"
        assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2]
        assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in ref_rows]
        assert [r["tpr/mean"] for r in rows] == [r["tpr/mean"] for r in ref_rows]
        for key in ("loss", "grad_norm", "kl"):
            torch.testing.assert_close(torch.tensor([r[key] for r in rows]), torch.tensor([r[key] for r in ref_rows]),
                                       rtol=1e-5, atol=1e-9, msg=f"{key}, {what}")
        assert all(r["grad_norm"] > 0 for r in rows)
        got = engine.load_model(str(out / "final"), dtype=torch.float32).state_dict()
        assert got.keys() == ref.keys() and len(got) > 0
        for name, t in ref.items():
            torch.testing.assert_close(got[name], t, rtol=0, atol=2e-4, msg=f"{name}, {what}")
    start = engine.load_model(student, dtype=torch.float32).state_dict()
    moved = [not torch.equal(start[n], t) for n, t in ref.items()]
    assert sum(moved) >= len(moved) - 1  # training moved the weights: the match is not of the initial ones


@pytest.mark.slow
def test_multi_turn_two_ranks_equal_one_process(student, tmp_path):
    """--multi_turn (LiveAssistant's trajectories, turn- and trajectory-level credit): each rank rolls out its
    prompts' trajectories (seeded by their places in the global batch) and decodes its share of the per-turn
    reference lengths; the turn rewards are joined for the advantages. The tolerances above, but the weights are
    compared by how many differ by more than lr / 10: the same near-eps AdamW effect, which here flips the sign of
    a few near-zero step-2 gradients (elements of rarely used embedding rows and experts), so those elements move
    ~lr apart (seen: 1 element each of two tensors up to 6.7e-4 with one tiny tokenizer; 86 of 213k elements over
    1e-3, up to 1.5e-2, with the next). A lost share or a wrongly normalised loss moves most weights by ~lr, so
    fewer than 1 in 1,000 elements may differ by more than 1e-3."""
    from livemoe import engine

    data = tmp_path / "mt.jsonl"
    write_jsonl(str(data), multi_turn_records())
    flags = [*REWARD, "--device", "cpu", "--data", str(data), "--multi_turn", "true", "--turn_weight", "0.5",
             "--scale_rewards", "batch"]  # batch: the advantages need every rank's rewards
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(args(student, one, *flags)) == 0
    res = torchrun_grpo(2, args(student, two, *flags))
    assert res.returncode == 0, res.stderr[-3000:]
    ref_rows, rows = read_metrics(str(one / "metrics.jsonl")), read_metrics(str(two / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [r["step"] for r in ref_rows] == [1, 2]
    for key in ("reward/mean", "reward/std", "reward/varied/mean", "tpr/mean", "tpr/max", "zero_variance_groups"):
        assert [r[key] for r in rows] == [r[key] for r in ref_rows], key
    for key in ("loss", "grad_norm", "kl"):
        # step 1 from the same weights: reduction order only (the loss, a mean of advantage-weighted terms that
        # nearly cancel, 1.4e-4 here, shows it in absolute terms: atol 1e-6); step 2 from weights that differ by
        # the near-eps AdamW effect below (up to 6.7e-4 on a few elements), which moves its figures by 1e-5 to
        # 7e-4 relative depending on the tiny tokenizer (seen 1.4e-5, then 2.6e-4 on grad norm and KL and 6.7e-4
        # on the loss after a teacher change); a lost share or a wrong normaliser moves them by far more than 1e-3
        for step, rtol, atol in ((0, 1e-5, 1e-6 if key == "loss" else 1e-9), (1, 1e-3, 1e-9)):
            torch.testing.assert_close(torch.tensor(rows[step][key]), torch.tensor(ref_rows[step][key]), rtol=rtol,
                                       atol=atol, msg=f"{key} at step {step + 1}")
    assert all(r["grad_norm"] > 0 for r in rows) and rows[0]["tpr/max"] > 10  # more than one turn's tokens
    ref = engine.load_model(str(one / "final"), dtype=torch.float32).state_dict()
    got = engine.load_model(str(two / "final"), dtype=torch.float32).state_dict()
    assert got.keys() == ref.keys() and len(got) > 0
    diffs = torch.cat([(got[name] - t).abs().flatten() for name, t in ref.items()])
    off = int((diffs > 1e-3).sum())
    assert off < diffs.numel() / 1000, f"{off} of {diffs.numel()} weights differ by more than 1e-3"


@pytest.mark.parametrize("extra, message", [
    (["--model", "auto"], "--model auto under torchrun: pass --model CHECKPOINT_DIR"),
])
def test_what_torchrun_does_not_run_is_refused_before_any_work(student, tmp_path, monkeypatch, capsys, extra, message):
    monkeypatch.setenv("WORLD_SIZE", "2")  # refused before the process group is joined: no ranks needed
    argv = args(student, tmp_path / "o", *REWARD)
    argv = argv[2:] if extra[0] == "--model" else argv  # args() starts with --model STUDENT
    assert main(argv + extra) == 2
    assert message in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "o" / "metrics.jsonl")


@pytest.mark.slow
def test_routing_replay_with_expert_parallel_two_ranks_equal_one_process(student, tmp_path):
    """--routing_replay R3 with --expert_parallel 2 on two gloo ranks (torchrun, the collectives' timeouts of
    livemoe.train.distributed): the same per-step loss, gradient norm, KL and routing disagreement as one process
    (each rank replays the decoder's experts of its own rollouts through the all-to-all); tolerances as above."""
    flags = [*REWARD, "--device", "cpu", "--routing_replay", "R3", "--max_steps", "1"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert main(args(student, one, *flags)) == 0
    res = torchrun_grpo(2, args(student, two, *flags, "--expert_parallel", "2"))
    assert res.returncode == 0, res.stderr[-3000:]
    ref_rows, rows = read_metrics(str(one / "metrics.jsonl")), read_metrics(str(two / "metrics.jsonl"))
    assert [r["reward/mean"] for r in rows] == [r["reward/mean"] for r in ref_rows]
    for key in ("loss", "grad_norm", "kl", "aux_loss", "mismatch/routing_disagreement"):
        torch.testing.assert_close(torch.tensor([r[key] for r in rows]), torch.tensor([r[key] for r in ref_rows]),
                                   rtol=1e-5, atol=1e-9, msg=key)
    assert rows[0]["grad_norm"] > 0


@pytest.mark.slow
def test_async_rollouts_two_ranks(student, tmp_path):
    """--async_rollouts under torchrun (2 gloo ranks; each rank's producer thread decodes its share of every batch
    with its own copy of the gathered policy, its gathers on a gloo group of its own, Distributed.side_channel):
    - S = 0 is the synchronous 2-rank run exactly: rewards, lengths, losses, grad norms, KL and the exported weights
      bit for bit (the same rollouts from the same weights, then the same update);
    - S = 1 rolls out step j with version max(0, j - 1) on every rank (async/version 0, 0, 1) and gives the
      one-process S = 1 run's rewards and lengths exactly (the same tokens: each rank decoded with the right
      version) and its losses, grad norms and KL to the 2-rank tolerance above (rtol 1e-5; --rollout_is none);
    - --partial_rollouts at S = 1: whatever the timing, every step's tokens are from a version in [t - 1, t]."""
    from livemoe import engine

    flags = [*REWARD, "--device", "cpu", "--max_steps", "3", "--rollout_is", "none"]
    s0 = ["--async_rollouts", "true", "--max_staleness", "0"]
    s1 = ["--async_rollouts", "true", "--max_staleness", "1"]
    rows = {}
    for name, extra in (("sync", []), ("s0", s0), ("s1", s1), ("partial", [*s1, "--partial_rollouts", "true"])):
        res = torchrun_grpo(2, args(student, tmp_path / name, *flags, *extra))
        assert res.returncode == 0, f"{name}: {res.stderr[-3000:]}"
        rows[name] = read_metrics(str(tmp_path / name / "metrics.jsonl"))
        assert [r["step"] for r in rows[name]] == [1, 2, 3], name
    for key in ("reward/mean", "tpr/mean", "loss", "grad_norm", "kl"):
        assert [r[key] for r in rows["s0"]] == [r[key] for r in rows["sync"]], key
    assert [r["async/version"] for r in rows["s0"]] == [0, 1, 2]
    ref = engine.load_model(str(tmp_path / "sync" / "final"), dtype=torch.float32).state_dict()
    got = engine.load_model(str(tmp_path / "s0" / "final"), dtype=torch.float32).state_dict()
    assert got.keys() == ref.keys() and all(torch.equal(got[n], t) for n, t in ref.items())

    assert [r["async/version"] for r in rows["s1"]] == [0, 0, 1]
    assert [r["async/staleness"] for r in rows["s1"]] == [0, 1, 1]
    assert rows["s1"][2]["reward/mean"] != rows["sync"][2]["reward/mean"] or \
        rows["s1"][1]["loss"] != rows["sync"][1]["loss"]  # S = 1 is not the synchronous run
    one = tmp_path / "one"
    assert main(args(student, one, *flags, *s1)) == 0
    ref_rows = read_metrics(str(one / "metrics.jsonl"))
    assert [r["async/version"] for r in ref_rows] == [0, 0, 1]
    for key in ("reward/mean", "tpr/mean"):
        assert [r[key] for r in rows["s1"]] == [r[key] for r in ref_rows], key
    for key in ("loss", "grad_norm", "kl"):
        torch.testing.assert_close(torch.tensor([r[key] for r in rows["s1"]]),
                                   torch.tensor([r[key] for r in ref_rows]), rtol=1e-5, atol=1e-9, msg=key)

    for t, r in enumerate(rows["partial"]):
        assert 0 <= r["async/staleness"] <= 1 and t - r["async/version"] == r["async/staleness"]
        assert 0 <= r["async/staleness_mean"] <= r["async/staleness"]
