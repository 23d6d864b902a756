"""python -m train.live end to end at toy size on the committed student: the three stages' table,
the saved checkpoints, --replay, and bad options refused with one line."""
import json
import os

import pytest

from livemoe.train.live.__main__ import main

pytestmark = pytest.mark.usefixtures("one_thread")
TOY = ["--train_sessions", "4", "--eval_sessions", "1", "--num_intervals", "2", "--sft_steps", "2",
       "--sft_batch_size", "2", "--gspo_steps", "1", "--sessions_per_step", "1", "--num_generations", "2",
       "--num_iterations", "1", "--max_message_chars", "24", "--progress", "false"]


def test_all_stages_then_replay(tmp_path, capsys):
    out = tmp_path / "run"
    assert main(TOY + ["--output_dir", str(out), "--compare_plain", "true", "--gspo_sessions", "3",
                       "--results", str(tmp_path / "results.json")]) == 0
    res = json.loads((tmp_path / "results.json").read_text())
    assert list(res["rows"]) == ["base student", "plain multi-turn SFT", "MA-MSFT", "SM-GSPO"]
    for row in res["rows"].values():
        assert row["intervals"] == 2 and 0 <= row["state"] <= 100 and row["latency_ms"] > 0 and row["decode_gflops"] > 0
    printed = capsys.readouterr().out
    assert "| SM-GSPO |" in printed and "state acc" in printed
    assert "3 fresh sessions for SM-GSPO" in printed
    for stage in ("msft", "gspo"):
        assert os.path.isfile(out / stage / "model" / "config.json")
        assert (out / stage / "metrics.jsonl").read_text().count("\n") >= 1
    assert main(TOY + ["--replay", str(out / "gspo" / "model")]) == 0
    replayed = capsys.readouterr().out
    assert replayed.count("-> ") == 2 and "(gold: " in replayed


@pytest.mark.parametrize("argv,why", [
    (["--stage", "rl"], "--stage must be one of"),
    (["--num_generations", "1"], "--num_generations must be >= 2"),
    (["--balance", "2"], "--balance must be in"),
    (["--gspo_balance", "-0.5"], "--gspo_balance must be in"),
    (["--credit", "token"], "--credit must be one of"),
    (["--gspo_scale_rewards", "std"], "--gspo_scale_rewards must be one of"),
    (["--replay", "/no/such/dir"], "--replay /no/such/dir: no such checkpoint"),
    (["--data", "/no/such.jsonl"], "--data /no/such.jsonl: no such file"),
    (["--unrecorded_courtesy", "1.5"], "--unrecorded_courtesy must be in [0, 1]"),
    (["--gspo_sessions", "-1"], "--gspo_sessions must be >= 0"),
])
def test_bad_options_are_one_line_and_exit_2(argv, why, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err


@pytest.mark.parametrize("flag,why", [
    (["--gspo_sessions", "8"], "--gspo_sessions draws fresh sessions of the synthetic world"),
    (["--unrecorded_courtesy", "0.2"], "--unrecorded_courtesy shapes the synthetic world's recordings"),
])
def test_synthetic_world_options_are_refused_with_data(flag, why, tmp_path, capsys):
    from livemoe.train.live.data import save_sessions
    from livemoe.train.live.world import make_sessions

    data = tmp_path / "s.jsonl"
    save_sessions(make_sessions(2, seed=0), data)
    assert main(["--data", str(data)] + flag) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err
