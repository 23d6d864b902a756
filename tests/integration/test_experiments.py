"""`python -m experiments`: the listing, clear errors (a bad name lists the names), and each experiment's
--tiny configuration end to end on a tiny random student: its report has the table's columns and rows, finite
numbers, the command, the date and the machine."""
import json
import math
import shutil

import pytest
import torch

from test_rollout import make_student
from experiments import EXPERIMENTS, length_sweep, moe_vs_dense, reward_ablation, rollout_mismatch
from experiments.__main__ import main
from livemoe.engine import load_model
from livemoe.train.config import DEFAULT_STUDENT
from livemoe.train.live.omni import media_processor
from livemoe.train.metrics import read_metrics

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/fixtures.py: tiny matmuls, shared CPU


@pytest.fixture(scope="module")
def student(tmp_path_factory):
    return make_student(tmp_path_factory.mktemp("student") / "ckpt")


def run_tiny(name, student, tmp_path, *extra):
    """Runs NAME --tiny; checks what every report holds; returns (results.json, report dir, work dir)."""
    out, work = tmp_path / "report", tmp_path / "work"
    argv = [name, "--tiny", "--model", student, "--output_dir", str(out), "--work_dir", str(work), "--no_progress",
            *extra]
    assert main(argv) == 0
    results = json.loads((out / "results.json").read_text())
    readme = (out / "README.md").read_text()
    assert results["columns"] == EXPERIMENTS[name].COLUMNS
    assert "| " + " | ".join(results["columns"]) + " |" in readme
    assert f"- command: `python -m experiments {name} --tiny" in readme
    assert "- date: " in readme and "- machine: " in readme and " cores" in readme
    numbers = [x for row in results["rows"] for x in row if isinstance(x, (int, float))]
    assert len(numbers) >= len(results["rows"]) > 0
    assert all(math.isfinite(x) for x in numbers), results["rows"]
    assert results["arms"] and all(c.startswith("python -m train.") for c in results["arms"].values())
    return results, out, work


def test_the_listing_names_every_experiment(capsys):
    assert main([]) == 0
    listed = capsys.readouterr().out
    assert len(EXPERIMENTS) == 6
    for name, module in EXPERIMENTS.items():
        assert f"{name}  " in listed and module.TITLE in listed


@pytest.mark.parametrize("argv, message", [
    (["nope"], "no experiment named 'nope'; the experiments are: rft_vs_sft, length_sweep, reward_ablation, "
               "moe_vs_dense, rollout_mismatch, live_media"),
    (["rft_vs_sft", "--start", "."], "--start: rft_vs_sft does not start from an RFT student"),
    (["moe_vs_dense", "--model", "/no/such/dir"], "--model /no/such/dir: not a checkpoint directory"),
])
def test_bad_input_is_one_clear_line(argv, message, capsys):
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_rft_vs_sft(student, tmp_path):
    results, _, _ = run_tiny("rft_vs_sft", student, tmp_path)
    rows = {r[0]: r for r in results["rows"]}
    assert list(rows) == ["student (no fine-tuning)", "SFT (all teacher samples)", "RFT (judge-filtered)"]
    sft, rft = rows["SFT (all teacher samples)"], rows["RFT (judge-filtered)"]
    assert sft[2] == rft[2] == 2  # the same optimizer steps
    assert sft[1] == 6 * 2 > rft[1] > 0  # every teacher sample (6 rooms x k=2) vs the judge's picks
    assert "--selection all" in results["arms"]["sft"] and "--selection first" in results["arms"]["rft"]


def test_length_sweep_from_a_given_start(student, tmp_path):
    results, out, _ = run_tiny("length_sweep", student, tmp_path, "--start", student)
    rows = results["rows"]
    assert len(rows) == 1 + len(length_sweep.TINY_BANDS) and rows[0][2] == 1.0  # the start, then one per band
    assert [tuple(r[:2]) for r in rows[1:]] == length_sweep.TINY_BANDS
    assert "rft" not in results["arms"]  # --start: no RFT stage
    assert (out / "length_sweep.png").stat().st_size > 0


def test_reward_ablation_runs_its_own_rft_start(student, tmp_path):
    results, _, work = run_tiny("reward_ablation", student, tmp_path)
    rows = results["rows"]
    assert [r[0] for r in rows[1:]] == [r[0] for r in reward_ablation.REWARDS]
    assert [tuple(r[1:4]) for r in rows[1:]] == [r[2:] for r in reward_ablation.REWARDS]
    assert list(results["arms"]) == ["rft", "correct", "correct_helpful", "full"]
    assert f"--model {work / 'rft' / 'final'}" in results["arms"]["full"]  # GRPO starts from that RFT student


def test_moe_vs_dense(student, tmp_path):
    results, out, work = run_tiny("moe_vs_dense", student, tmp_path)
    rows = {r[0]: r for r in results["rows"]}
    assert list(rows) == ["MoE", "dense, equal active", "dense, equal total"]
    moe_cfg = json.loads(open(f"{student}/config.json").read())
    one_unit = 3 * moe_cfg["hidden_size"] * moe_cfg["num_hidden_layers"]  # parameters per unit of MLP width
    assert rows["MoE"][1] > rows["MoE"][2]  # total > active
    assert abs(rows["dense, equal active"][1] - rows["MoE"][2]) <= one_unit / 2
    assert abs(rows["dense, equal total"][1] - rows["MoE"][1]) <= one_unit / 2
    for name in rows:  # a dense model's active = total
        assert name == "MoE" or rows[name][1] == rows[name][2]
        steps = [r["step"] for r in read_metrics(str(work / moe_vs_dense.slug(name) / "metrics.jsonl"))
                 if "eval_loss" in r]
        assert steps == [0, 1, 2]  # --eval_every 1 over 2 steps
    assert (out / "moe_vs_dense.png").stat().st_size > 0
    moe_line = next(line for line in (out / "README.md").read_text().splitlines() if line.startswith("| MoE |"))
    assert moe_line.split(" | ")[4] == f"{rows['MoE'][4]:.3f}"  # losses with 3 decimals, the rest with 1
    assert moe_line.split(" | ")[-1] == f"{rows['MoE'][-1]:.1f} |"


def test_rollout_mismatch_from_a_given_start(student, tmp_path):
    """bf16 rollouts against an fp32 trainer, four arms: the mismatch is measured in each, non-zero; the exact
    mode's fifth arm has none (|dlogp| max and routing disagreement exactly 0)."""
    results, out, _ = run_tiny("rollout_mismatch", student, tmp_path, "--start", student)
    rows = results["rows"]
    assert [r[0] for r in rows[1:]] == [label for label, _, _ in rollout_mismatch.ARMS]
    mismatched, exact = rows[1:-1], rows[-1]
    assert all(r[1] == 1 and r[2] > 0 and r[4] >= 0 for r in mismatched)  # one seed; |dlogp|: bf16 vs fp32 differ
    assert exact[1] == 1 and exact[2] == 0.0 and exact[3] == 0.0 and exact[5] == 0.0
    arms = results["arms"]
    assert "--rollout_dtype bfloat16" in arms["plain_seed0"] and "--routing_replay R3" in arms["r3_seed0"]
    assert "--exact_rollouts true" in arms["exact_seed0"] and "--rollout_dtype" not in arms["exact_seed0"]
    assert (out / "rollout_mismatch.png").stat().st_size > 0



@pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="live_media speaks the host's lines with espeak-ng, "
                                                              "which is not installed (apt-get install espeak-ng)")
def test_live_media_text_only_against_multimodal(tmp_path):
    """Both arms on the same held-out sessions said and shown; the multimodal arm is a thinker made from the student
    (its encoders frozen, projectors trained), the text arm the student on the sessions without their media."""
    results, _, work = run_tiny("live_media", DEFAULT_STUDENT, tmp_path)
    rows = results["rows"]
    policies = ["text-only (student), base student", "text-only (student), MA-MSFT",
                "multimodal (thinker), base student", "multimodal (thinker), MA-MSFT"]
    assert [(r[0], r[1]) for r in rows] == [(p, f"{m} only") for p in policies for m in ("said", "shown")]
    said, shown = rows[0], rows[1]
    assert said[3] == shown[3] and said[5] == shown[5]  # the same sessions both ways
    assert "--train_projector" in results["arms"]["multimodal"] and "--train_projector" not in results["arms"]["text_only"]
    assert (work / "thinker" / "config.json").is_file()
    heard = [json.loads(line) for line in (work / "data" / "heldout_media.jsonl").read_text().splitlines()]
    text = [json.loads(line) for line in (work / "data" / "heldout_text.jsonl").read_text().splitlines()]
    for s, t in zip(heard, text):
        for iv, tv in zip(s["intervals"], t["intervals"]):
            media = [e for e in iv["events"] if e["type"] in ("audio", "video")]
            assert len(media) == 1 and media[0]["type"] == ("audio" if s["media_mode"] == "said" else "video")
            assert tv["events"] == [e for e in iv["events"] if e not in media]  # the text arm: the same, no media
            assert not any(e.get("text", "").startswith("news! ") for e in iv["events"])
    # the random encoders' rows weigh about as much as a token's embedding (make_thinker's match_media_scale, measured
    # on noise; a clip or a card differs from that by less than the bounds)
    thinker = load_model(str(work / "thinker"))
    processor, embed = media_processor(thinker), float(thinker.model.embed_tokens.weight.detach().norm(dim=-1).mean())
    for kind in ("audio", "video"):
        path = next(e["path"] for s in heard for iv in s["intervals"] for e in iv["events"] if e["type"] == kind)
        with open(path, "rb") as f:
            item = getattr(processor, kind)(f.read(), path)
        with torch.no_grad():
            rows = (thinker.encode_audio(item.data) if kind == "audio" else
                    thinker.encode_vision(item.data, item.grid_thw)).embeds
        ratio = float(rows.norm(dim=-1).mean()) / embed
        assert 0.6 < ratio < 1.6, (kind, ratio)  # unscaled, the rows were a ninth (audio) and a half (video)
