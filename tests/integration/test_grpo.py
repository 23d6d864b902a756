"""`livemoe.train.grpo` end to end on a tiny random MoE checkpoint (CPU, fp32, seconds): every trainable
parameter changes and the loss stays finite; the GSPO path; multi-turn trajectories; exact resume;
clear errors for bad options."""
import json
import math
import os
import sys
import types

import pytest
import torch

from livemoe.engine.model.loader import load_model
from livemoe.kernels.batch_invariant import unavailable_reason
from fixtures import assert_stopped_on_nonfinite
from test_rollout import make_student
from livemoe.train.config import ConfigError, parse_config
from livemoe.train.data import write_jsonl
from livemoe.train.grpo.__main__ import main
from livemoe.train.grpo.config import GRPOConfig
from livemoe.train.grpo.trainer import GRPOTrainer
from livemoe.train.metrics import read_metrics
from livemoe.train.synthetic.world import attribute_question, make_rooms, products_of


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/fixtures.py: tiny matmuls, shared CPU


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return make_student(tmp_path_factory.mktemp("student") / "ckpt")


@pytest.fixture(autouse=True)
def varied_reward(monkeypatch):
    """A random model's answers all fail the judge (zero variance, no signal): add a reward that
    differs between samples, so every step has a gradient."""
    mod = types.ModuleType("grpo_test_rewards")
    mod.varied = lambda record, completion, info: (sum(map(ord, completion)) % 7) / 6.0
    monkeypatch.setitem(sys.modules, "grpo_test_rewards", mod)


def args(student, out, *extra):
    return ["--model", student, "--output_dir", str(out), "--train_rooms", "4", "--eval_rooms", "0",
            "--batch_size", "2", "--num_generations", "4", "--max_new_tokens", "10", "--max_steps", "2",
            "--lr", "1e-2", "--warmup_steps", "0", "--reward_fns", "grpo_test_rewards:varied",
            "--progress", "false", "--plot", "false", "--rollout_kv_bytes", str(8 * 2**20), *extra]


def state(path):
    return {k: v.clone() for k, v in load_model(path, dtype=torch.float32).state_dict().items()}


def test_end_to_end_every_parameter_changes_and_the_loss_stays_finite(student, tmp_path):
    out = tmp_path / "run"
    assert main(args(student, out, "--max_steps", "3", "--eval_rooms", "2", "--eval_max_new_tokens", "8",
                     "--micro_batch_size", "3", "--plot", "true", "--warmup_steps", "3")) == 0
    start, end = state(student), state(str(out / "final"))  # the HF export loads back
    assert start.keys() == end.keys()
    unchanged = [k for k in start if torch.equal(start[k], end[k])]
    assert unchanged == []
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in ("loss", "aux_loss", "reward/mean", "reward/std", "reward/correct/mean", "reward/helpful/mean",
                "reward/length/mean", "reward/varied/mean", "tpr/mean", "tpr/min", "tpr/max", "truncated_frac",
                "zero_variance_groups", "clip_ratio/low_mean", "clip_ratio/high_mean", "kl", "entropy",
                "ratio/mean", "grad_norm", "time/rollout_s", "time/update_s", "tokens_per_s",
                "decode_gflops_per_response", "logprob_diff/mean", "logprob_diff/max"):
        assert all(key in r and r[key] == r[key] and abs(r[key]) != float("inf") for r in rows), key
    assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # the policy starts as the reference
    assert rows[-1]["kl"] > 0
    assert max(r["logprob_diff/max"] for r in rows) < 2e-5  # decoder old_logprobs vs the fused kernel, fp32
    assert [r["lr"] for r in rows] == pytest.approx([1e-2 / 3, 2e-2 / 3, 1e-2])  # the lr each step used (warm-up)
    assert os.path.isfile(out / "curves.png") and os.path.isfile(out / "curves_more.png")
    table = (out / "eval_table.md").read_text()
    assert "| Correct. | Helpful. | TPR |" in table and "+ GRPO" in table
    summary = json.loads((out / "summary.json").read_text())
    assert summary["before"]["prompts"] == 2 and summary["before"]["n"] == 2 * 4  # 4 sampled responses each
    assert "tpr" in summary["after"] and "tpr_reduction_pct" in summary


def test_gspo_sequence_level_with_several_passes(student, tmp_path):
    out = tmp_path / "gspo"
    assert main(args(student, out, "--importance_sampling_level", "sequence", "--num_iterations", "2",
                     "--epsilon", "3e-4", "--epsilon_high", "4e-4", "--loss_type", "dr_grpo", "--beta", "0")) == 0
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert all(r["loss"] == r["loss"] for r in rows) and "kl" not in rows[0]
    # the second pass sees ratios away from 1 at GSPO's tiny epsilons: some sequences clip
    assert max(r["clip_ratio/region_mean"] for r in rows) > 0
    assert not torch.equal(state(student)["lm_head.weight"], state(str(out / "final"))["lm_head.weight"])


def multi_turn_records(n=4, seed=0):
    """Synthetic rooms with two follow-up attribute questions each (judged per turn by the rule judge)."""
    import random

    rng = random.Random(seed)
    out = []
    for room in make_rooms(n, seed=seed):
        followups = []
        for _ in range(2):
            p = rng.choice(products_of(room))
            attr = rng.choice(sorted(p.attributes))
            followups.append({"question": attribute_question(rng, p, attr),
                              "meta": {"kind": "attribute", "link": p.link, "attribute": attr,
                                       "value": p.attributes[attr]}})
        out.append({**room, "followups": followups})
    return out


def test_multi_turn_trajectories(student, tmp_path):
    data = tmp_path / "mt.jsonl"
    write_jsonl(str(data), multi_turn_records())
    out = tmp_path / "mt"
    cfg = parse_config(GRPOConfig, args(student, out, "--data", str(data), "--multi_turn", "true",
                                        "--importance_sampling_level", "sequence", "--turn_weight", "0.5"))
    trainer = GRPOTrainer(cfg)
    trainer.compute_reference_lengths()
    assert {k.rsplit("#", 1)[1] for k in trainer.ref_lengths} == {"0", "1", "2"}  # L_ref per turn
    batch, m = trainer.rollout_phase(0)
    # only assistant tokens are trained on: per row, the mask covers exactly the turn spans
    assert batch["completion_mask"].sum() < (batch["attention_mask"].sum() - batch["attention_mask"].shape[0])
    # advantages are constant within a turn and 0 off the mask
    assert (batch["advantages"] * (1 - batch["completion_mask"])).abs().max() == 0
    upd = trainer.update_phase(batch)
    assert upd["loss"] == upd["loss"] and upd["logprob_diff/max"] < 2e-5
    assert m["reward/mean"] == m["reward/mean"]


def test_resume_gives_the_same_model(student, tmp_path):
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(args(student, straight, "--max_steps", "4")) == 0
    assert main(args(student, resumed, "--max_steps", "2")) == 0
    trainer = GRPOTrainer(parse_config(GRPOConfig, args(student, resumed, "--max_steps", "4", "--resume", "auto")))
    assert trainer.resume_from.endswith("step-00000002") and trainer.step == 2  # really continues
    trainer.train()
    # L_ref of the prompts first used after the resume came from the starting checkpoint, not the policy
    ref = [json.loads((d / "checkpoints" / "step-00000004" / "trainer_state.json").read_text())["ref_lengths"]
           for d in (straight, resumed)]
    assert ref[0] == ref[1] and len(ref[0]) == 4
    a, b = state(str(straight / "final")), state(str(resumed / "final"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)  # same ops, same order: bit-exact
    ra, rb = read_metrics(str(straight / "metrics.jsonl")), read_metrics(str(resumed / "metrics.jsonl"))
    assert [r["step"] for r in rb] == [1, 2, 3, 4]
    assert [r["reward/mean"] for r in ra] == [r["reward/mean"] for r in rb]


def test_beta_zero_loads_no_reference(student, tmp_path):
    trainer = GRPOTrainer(parse_config(GRPOConfig, args(student, tmp_path / "b0", "--beta", "0")))
    assert trainer.ref_model is None
    trainer = GRPOTrainer(parse_config(GRPOConfig, args(student, tmp_path / "b1")))
    assert trainer.ref_model is not None and not any(p.requires_grad for p in trainer.ref_model.parameters())


@pytest.mark.parametrize("flags, match", [
    (["--num_generations", "1"], "num_generations"),
    (["--loss_type", "ppo"], "loss_type"),
    (["--scale_rewards", "std"], "scale_rewards"),
    (["--temperature", "0"], "temperature"),
    (["--epsilon", "1.5"], "epsilon_low"),
    (["--lambda_lower", "0.6"], "lambda_lower"),
    (["--reward_fns", "no_such_module:fn"], "cannot be imported"),
    (["--old_logprobs", "cache"], "old_logprobs"),
    (["--partial_rollouts", "true"], "add --async_rollouts"),
    (["--max_staleness", "2"], "add it"),
    (["--dynamic_sampling_rounds", "0"], "dynamic_sampling_rounds"),
    (["--dynamic_sampling_rounds", "8"], "add --dynamic_sampling"),
    (["--max_tokens_per_micro_batch", "-1"], "max_tokens_per_micro_batch"),
    (["--micro_batch_size", "0"], "micro_batch_size"),
    # an explicit row count would be ignored by the token-balanced packing: refused, not dropped
    (["--micro_batch_size", "32", "--max_tokens_per_micro_batch", "4096"], "give one of them"),
])
def test_bad_options_are_clear_errors(student, tmp_path, flags, match):
    with pytest.raises(ConfigError, match=match):
        parse_config(GRPOConfig, args(student, tmp_path / "x", *flags))


def test_main_reports_a_missing_checkpoint(tmp_path, capsys):
    assert main(["--model", str(tmp_path / "nowhere"), "--output_dir", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--model" in err and "checkpoint directory" in err


def test_model_auto_runs_the_rft_default_once_when_its_student_is_missing(student, tmp_path, monkeypatch):
    import shutil

    from livemoe.train.grpo.start import resolve_start
    from livemoe.train.rft import __main__ as rft

    root = tmp_path / "rft"
    calls = []

    def fake_rft_main(argv):
        calls.append(argv)
        shutil.copytree(student, root / "final")
        return 0

    monkeypatch.setattr(rft, "main", fake_rft_main)
    cfg = parse_config(GRPOConfig, ["--rft_output", str(root)])
    assert cfg.model == "auto"
    assert resolve_start(cfg) == str(root / "final")
    assert resolve_start(cfg) == str(root / "final")
    assert calls == [["--output_dir", str(root)]]  # run once, then found
    monkeypatch.setattr(rft, "main", lambda argv: 2)
    with pytest.raises(ConfigError, match="RFT default failed"):
        resolve_start(parse_config(GRPOConfig, ["--rft_output", str(tmp_path / "empty")]))


def test_a_diverging_run_stops_keeps_its_last_good_checkpoint_and_exports_nothing(student, tmp_path, capsys):
    out = tmp_path / "nan"
    code = main(args(student, out, "--lr", "1e9", "--max_steps", "8", "--save_every", "1", "--keep_last", "1",
                     "--max_nonfinite_steps", "2"))
    assert_stopped_on_nonfinite(code, capsys.readouterr().err, out)


def test_mismatch_metrics_and_routing_replay_each_step(student, tmp_path):
    """Issue 32: every step logs the rollout-trainer mismatch (|dlogp|, k3 KL, perplexity ratio, routing
    disagreement overall and per MoE layer) and the rollout correction's weights; with bf16 rollouts (C++ ops)
    against the trainer's bf16 autocast forward they are non-zero, and R3 trains through the replayed routing."""
    out = tmp_path / "r3"
    assert main(args(student, out, "--bf16", "true", "--routing_replay", "R3", "--max_steps", "1")) == 0
    row = read_metrics(str(out / "metrics.jsonl"))[0]
    keys = ("logprob_diff/mean", "logprob_diff/max", "mismatch/k3_kl", "mismatch/ppl_ratio",
            "mismatch/routing_disagreement", "mismatch/routing_disagreement/layer_0",
            "mismatch/routing_disagreement/layer_1", "rollout_is/weight_mean", "rollout_is/weight_max",
            "rollout_is/over_threshold_frac", "rollout_rs/rejected_frac")
    assert all(k in row and row[k] == row[k] for k in keys), [k for k in keys if k not in row]
    assert row["logprob_diff/max"] > 1e-4 and row["mismatch/k3_kl"] > 0 and row["grad_norm"] > 0
    assert 0 < row["rollout_is/weight_max"] <= float("inf") and row["rollout_is/over_threshold_frac"] == 0


def test_routing_replay_of_multi_turn_trajectories(student, tmp_path):
    """A trajectory's routed experts are its last turn's (that request ran every earlier token): they fit the
    whole trajectory, and in fp32 the decoder and the trainer route alike."""
    data = tmp_path / "mt.jsonl"
    write_jsonl(str(data), multi_turn_records())
    out = tmp_path / "mt_r3"
    assert main(args(student, out, "--routing_replay", "R3", "--data", str(data), "--multi_turn", "true",
                     "--max_steps", "1")) == 0
    row = read_metrics(str(out / "metrics.jsonl"))[0]
    assert row["tpr/max"] > 10 and row["grad_norm"] > 0 and row["mismatch/routing_disagreement"] == 0.0


def test_speculative_rollouts_give_the_same_run(student, tmp_path):
    """--rollout_speculative_config through the CLI's parsing: the seeded ngram rollouts are the plain ones, so the
    rewards are too, and the decoder did draft."""
    spec = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "disable_by_batch_size": 64}'
    plain, fast = tmp_path / "plain", tmp_path / "fast"
    assert main(args(student, plain, "--max_steps", "2")) == 0
    trainer = GRPOTrainer(parse_config(GRPOConfig, args(student, fast, "--max_steps", "2",
                                                        "--rollout_speculative_config", spec)))
    trainer.train()
    assert trainer.rollouts.llm.stats()["spec_drafted_tokens"] > 0
    ra, rb = read_metrics(str(plain / "metrics.jsonl")), read_metrics(str(fast / "metrics.jsonl"))
    assert [r["reward/mean"] for r in rb] == [r["reward/mean"] for r in ra]


def _step_loss_and_grads(trainer, batch, start):
    """update_phase's loss and the gradients it steps with, from the weights `start`."""
    trainer.model.load_state_dict(start)
    seen = {}
    clip = trainer.dist.clip_grad_norm_

    def capture(params, max_norm):
        seen.update({n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None})
        return clip(params, max_norm)

    trainer.dist.clip_grad_norm_ = capture
    try:
        m = trainer.update_phase({k: v.clone() for k, v in batch.items()})
    finally:
        trainer.dist.clip_grad_norm_ = clip
    return m["loss"], seen


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_token_balanced_micro_batches_give_the_whole_batch_loss_and_gradients(student, tmp_path, loss_type):
    """--max_tokens_per_micro_batch packs rows into unequal micro-batches; each is weighted by its share, so the
    step's loss and gradients are those of the whole batch in one micro-batch (fp32: equal up to summation
    order and padding widths: 1e-5 relative, and 1e-5 of each tensor's largest gradient). The load-balancing term is a per-micro-batch mean (not linear in the
    tokens), so it is off here."""
    trainer = GRPOTrainer(parse_config(GRPOConfig, args(student, tmp_path / "p", "--lambda_aux", "0",
                                                        "--loss_type", loss_type, "--batch_size", "3")))
    trainer.compute_reference_lengths()
    batch, _ = trainer.rollout_phase(0)
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    n = batch["input_ids"].shape[0]
    trainer.cfg.micro_batch_size = n
    whole_loss, whole = _step_loss_and_grads(trainer, batch, start)
    lengths = batch["attention_mask"].sum(1)
    trainer.cfg.max_tokens_per_micro_batch = int(lengths.max()) * 5  # 12 rows: 5 + 5 + 2 at least
    micro = trainer._micro_batches(batch)
    sizes = sorted(mb["input_ids"].shape[0] for mb in micro)
    assert len(micro) > 1 and sum(sizes) == n and sizes[0] < sizes[-1], sizes  # unequal micro-batches
    assert all(mb["input_ids"].numel() <= trainer.cfg.max_tokens_per_micro_batch for mb in micro)
    packed_loss, packed = _step_loss_and_grads(trainer, batch, start)
    assert packed_loss == pytest.approx(whole_loss, rel=1e-5, abs=1e-7)
    assert whole.keys() == packed.keys() and whole
    for k in whole:
        scale = float(whole[k].abs().max())  # fp32 sums in another order: 1e-5 of the tensor's largest entry
        torch.testing.assert_close(packed[k], whole[k], rtol=1e-5, atol=1e-5 * scale + 1e-9, msg=k)


@pytest.fixture
def spread_on_some_rooms(monkeypatch):
    """A reward that varies between samples for about half the rooms and is constant for the others."""
    mod = types.ModuleType("grpo_spread_rewards")
    mod.some = lambda record, completion, info: ((sum(map(ord, completion)) % 7) / 6.0
                                                 if sum(map(ord, record["id"])) % 2 else 0.5)
    mod.never = lambda record, completion, info: 0.5
    monkeypatch.setitem(sys.modules, "grpo_spread_rewards", mod)


def test_dynamic_sampling_refills_the_batch_with_groups_that_have_a_reward_spread(student, tmp_path,
                                                                                   spread_on_some_rooms):
    flags = ("--train_rooms", "16", "--batch_size", "4", "--w_correct", "0", "--w_helpful", "0", "--w_length", "0",
             "--reward_fns", "grpo_spread_rewards:some")
    trainer = GRPOTrainer(parse_config(GRPOConfig, args(student, tmp_path / "ds", *flags, "--dynamic_sampling", "true",
                                                        "--dynamic_sampling_rounds", "6")))
    trainer.compute_reference_lengths()
    assert len(trainer.ref_lengths) == 16  # refills may draw any prompt
    plain = GRPOTrainer(parse_config(GRPOConfig, args(student, tmp_path / "plain", *flags)))
    plain.ref_lengths = trainer.ref_lengths
    for step in range(3):
        out = trainer.sample_groups(step)
        dropped = sum(1 for g in out["sampled"] if len(set(g["rewards"])) == 1)
        assert len(out["kept"]) == 4 and all(len(set(g["rewards"])) > 1 for g in out["kept"])
        assert out["rounds"] == math.ceil((len(out["sampled"])) / 4) and len(out["sampled"]) >= 4 + dropped
        # round 0 is the batch a run without dynamic sampling rolls out, the same draws
        first = plain.sample_groups(step)["sampled"]
        assert [g["rewards"] for g in out["sampled"][:4]] == [g["rewards"] for g in first]
        batch, m = trainer.make_batch(out)
        assert batch["input_ids"].shape[0] == 4 * 4
        assert m["dynamic_sampling/rounds"] == out["rounds"] and m["dynamic_sampling/kept_groups"] == 4
        assert m["dynamic_sampling/dropped_groups"] == dropped == m["zero_variance_groups"]
    assert any(len(trainer.sample_groups(s)["sampled"]) > 4 for s in range(3))  # some step did refill
    # the cap: no group ever has a spread -> every round is used, nothing is trained
    out = tmp_path / "cap"
    assert main(args(student, out, *flags[:-1], "grpo_spread_rewards:never", "--dynamic_sampling", "true",
                     "--dynamic_sampling_rounds", "3", "--max_steps", "1")) == 0
    row = read_metrics(str(out / "metrics.jsonl"))[0]
    assert row["dynamic_sampling/rounds"] == 3 and row["dynamic_sampling/dropped_groups"] == 12
    assert row["dynamic_sampling/kept_groups"] == 0 and row["skipped_update"] == 1


def test_async_rollouts_with_staleness_zero_are_the_synchronous_run_and_one_lags_a_version(student, tmp_path):
    sync, asyn = tmp_path / "sync", tmp_path / "async0"
    assert main(args(student, sync, "--max_steps", "3")) == 0
    assert main(args(student, asyn, "--max_steps", "3", "--async_rollouts", "true", "--max_staleness", "0")) == 0
    a, b = state(str(sync / "final")), state(str(asyn / "final"))
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, msg=k)  # same rollouts, same updates: bit-exact
    ra, rb = read_metrics(str(sync / "metrics.jsonl")), read_metrics(str(asyn / "metrics.jsonl"))
    for key in ("reward/mean", "loss", "grad_norm", "tpr/mean"):
        assert [r[key] for r in ra] == [r[key] for r in rb], key
    assert [r["async/version"] for r in rb] == [0, 1, 2] and all(r["async/staleness"] == 0 for r in rb)
    stale = tmp_path / "async1"
    assert main(args(student, stale, "--max_steps", "3", "--async_rollouts", "true", "--max_staleness", "1")) == 0
    rc = read_metrics(str(stale / "metrics.jsonl"))
    assert [r["async/version"] for r in rc] == [0, 0, 1] and [r["async/staleness"] for r in rc] == [0, 1, 1]
    assert rc[0]["reward/mean"] == ra[0]["reward/mean"] and rc[1]["reward/mean"] != ra[1]["reward/mean"]
    # reproducible for a seed and S (docs/training.md): which version rolls out which batch is never timing's choice
    again = tmp_path / "async1_again"
    assert main(args(student, again, "--max_steps", "3", "--async_rollouts", "true", "--max_staleness", "1")) == 0
    rd = read_metrics(str(again / "metrics.jsonl"))
    for key in ("reward/mean", "loss", "grad_norm", "kl", "tpr/mean", "async/version"):
        assert [r[key] for r in rd] == [r[key] for r in rc], key
    c, d = state(str(stale / "final")), state(str(again / "final"))
    assert c.keys() == d.keys() and all(torch.equal(c[k], d[k]) for k in c)


def test_async_rollouts_one_step_stale_record_their_version_and_the_correction_weighs_the_gap(student, tmp_path):
    """S = 1: step 1 trains on rollouts of version 0 (the decoder's log-probs are version 0's), and the rollout
    correction's weights are pi_1 / pi_0 of those tokens (fp32: the decoder's log-probs equal the trainer's to
    2e-5, so the weights' mean matches the one from two trainer forwards to 1e-4)."""
    import copy

    cfg = parse_config(GRPOConfig, args(student, tmp_path / "s1", "--async_rollouts", "true", "--max_staleness", "1",
                                        "--rollout_is_threshold", "1e6", "--max_steps", "3"))
    trainer = GRPOTrainer(cfg)
    trainer.compute_reference_lengths()
    v0 = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    producer = trainer.start_async()
    try:
        m0 = trainer.train_step(0, producer)
        v1 = {k: v.clone() for k, v in trainer.model.state_dict().items()}
        out1 = producer.get(1)
        assert out1["version"] == 0 and m0["async/version"] == 0
        comps = [c for g in out1["sampled"] for c in g["comps"]]
        assert comps and all(c.versions == [0] * len(c.token_ids) for c in comps)
        batch, _ = trainer.make_batch(out1)
        probe = copy.deepcopy(trainer.model).eval()
        lps = {}
        with torch.no_grad():
            for name, weights in (("v0", v0), ("v1", v1)):
                probe.load_state_dict(weights)
                lps[name] = [trainer._logprobs(probe, mb)[0] for mb in trainer._micro_batches(batch)]
        masks = [mb["completion_mask"] for mb in trainer._micro_batches(batch)]
        behaviour = [mb["rollout_logprobs"] for mb in trainer._micro_batches(batch)]
        for lp0, lp1, old, mask in zip(lps["v0"], lps["v1"], behaviour, masks):
            assert ((lp0 - old).abs() * mask).max() < 2e-5  # the behaviour log-probs are version 0's
            assert ((lp1 - old).abs() * mask).max() > 1e-3  # and version 1 has moved: a gap to weigh
        tokens = sum(m.sum() for m in masks)
        expected = float(sum((torch.exp(lp1 - lp0) * m).sum() for lp0, lp1, m in zip(lps["v0"], lps["v1"], masks))
                         / tokens)
        producer.get = lambda step: out1
        m1 = trainer.train_step(1, producer)
        assert m1["async/version"] == 0 and m1["async/staleness"] == 1
        assert m1["rollout_is/weight_mean"] == pytest.approx(expected, rel=1e-4)
        assert abs(expected - 1) > 1e-4
    finally:
        producer.close()


@pytest.mark.parametrize("multi_turn", [False, True])
def test_partial_async_rollouts_train_within_the_staleness_bound(student, tmp_path, multi_turn):
    """--partial_rollouts: the producer loads each version as soon as it is published, interrupting the rollouts
    in flight (tests/unit/test_rollout.py checks the interrupted rollouts themselves, single- and multi-turn);
    whatever the timing, every token trained at step t is from a version in [t - S, t]."""
    out = tmp_path / "partial"
    extra = []
    if multi_turn:
        write_jsonl(str(tmp_path / "mt.jsonl"), multi_turn_records())
        extra = ["--data", str(tmp_path / "mt.jsonl"), "--multi_turn", "true"]
    assert main(args(student, out, "--max_steps", "4", "--async_rollouts", "true", "--max_staleness", "1",
                     "--partial_rollouts", "true", *extra)) == 0
    rows = read_metrics(str(out / "metrics.jsonl"))
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    for t, r in enumerate(rows):
        assert 0 <= r["async/staleness"] <= 1 and t - r["async/version"] == r["async/staleness"]
        assert 0 <= r["async/staleness_mean"] <= r["async/staleness"] and 0 <= r["async/interrupted_frac"] <= 1


def test_prompt_sharing_gives_the_unshared_update(student, tmp_path):
    """--prompt_sharing (the default) computes each prompt once for its K completions in the update's forwards
    (policy and reference); the step's loss, metrics and gradients are the unshared ones (fp32, 1e-5)."""
    trainer = GRPOTrainer(parse_config(GRPOConfig, args(student, tmp_path / "share", "--batch_size", "3")))
    trainer.compute_reference_lengths()
    batch, _ = trainer.rollout_phase(0)
    start = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    assert all(mb["shared"] is not None for mb in trainer._micro_batches(batch))
    shared_loss, shared = _step_loss_and_grads(trainer, batch, start)
    trainer.cfg.prompt_sharing = False
    assert all("shared" not in mb for mb in trainer._micro_batches(batch))
    plain_loss, plain = _step_loss_and_grads(trainer, batch, start)
    assert shared_loss == pytest.approx(plain_loss, rel=1e-5, abs=1e-7)
    assert shared.keys() == plain.keys() and plain
    for k in plain:
        scale = float(plain[k].abs().max())
        torch.testing.assert_close(shared[k], plain[k], rtol=1e-4, atol=1e-5 * scale + 1e-9, msg=k)


@pytest.mark.skipif(unavailable_reason() is not None, reason=f"exact mode: {unavailable_reason()}")
@pytest.mark.parametrize("bf16", ["false", "true"])
def test_exact_rollouts_leave_no_mismatch(student, tmp_path, bf16):
    """Issue 32, item 5: with --exact_rollouts the decoder's log-probs are the trainer's to the bit and every token is
    routed alike, so the step's mismatch is exactly 0 and R3 and the rollout correction have nothing to correct
    (weights exactly 1, none cut), in fp32 and with bf16 weights."""
    out = tmp_path / f"exact_{bf16}"
    assert main(args(student, out, "--device", "cpu", "--bf16", bf16, "--exact_rollouts", "true", "--routing_replay", "R3",
                     "--rollout_rs", "1.0001", "--max_steps", "1")) == 0
    row = read_metrics(str(out / "metrics.jsonl"))[0]
    assert row["logprob_diff/mean"] == 0.0 and row["logprob_diff/max"] == 0.0 and row["mismatch/k3_kl"] == 0.0
    assert row["mismatch/routing_disagreement"] == 0.0 and row["mismatch/ppl_ratio"] == 1.0
    assert row["rollout_is/weight_mean"] == 1.0 and row["rollout_is/weight_max"] == 1.0
    assert row["rollout_is/over_threshold_frac"] == 0.0 and row["rollout_rs/rejected_frac"] == 0.0
    assert row["grad_norm"] > 0
