"""Run configs: flags, YAML, flags win, validation in one place, save and read back."""
import pytest

from livemoe.train.config import ConfigError, RunConfig, format_config, options, parse_config, save_config
from livemoe.train.rft.config import RFTConfig


def test_defaults_follow_the_seed():
    cfg = parse_config(RFTConfig, [])
    assert (cfg.k, cfg.temperature, cfg.lambda_aux) == (4, 0.7, 0.01)


def test_flags_and_types():
    cfg = parse_config(RFTConfig, ["--k", "2", "--lr", "3e-4", "--tensorboard", "--progress", "false",
                                   "--data", __file__, "--teacher_url_unused_is_not_a_flag"][:-1])
    assert cfg.k == 2 and cfg.lr == 3e-4 and cfg.tensorboard is True and cfg.progress is False
    assert cfg.data == __file__


def test_yaml_then_flags_win(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("k: 8\nlr: 0.01\noutput_dir: from_yaml\ngradient_checkpointing: true\n")
    cfg = parse_config(RFTConfig, ["--config", str(y), "--k", "3"])
    assert cfg.k == 3 and cfg.lr == 0.01 and cfg.output_dir == "from_yaml" and cfg.gradient_checkpointing


def test_saved_config_reads_back(tmp_path):
    cfg = parse_config(RFTConfig, ["--k", "5", "--output_dir", str(tmp_path / "o")])
    path = save_config(cfg, cfg.output_dir)
    assert parse_config(RFTConfig, ["--config", path]) == cfg
    assert "k " in format_config(cfg) and ": 5" in format_config(cfg)


@pytest.mark.parametrize("argv, msg", [
    (["--k", "0"], "--k must be >= 1"),
    (["--k", "two"], "k must be int"),
    (["--batch_size", "0"], "--batch_size must be >= 1"),
    (["--lr", "-1"], "--lr must be >= 0"),
    (["--batching", "ragged"], "--batching must be one of"),
    (["--wrong_link_rate", "0.7", "--deflect_rate", "0.5"], "must be <= 1"),
    (["--teacher", "nowhere"], "--teacher 'nowhere'"),
    (["--data", "/no/such.jsonl"], "--data /no/such.jsonl: no such file"),
    (["--judge", "llm"], "--judge llm needs --judge_url"),
    (["--resume", "/no/ckpt"], "--resume '/no/ckpt'"),
    (["--eval_every", "-1"], "--eval_every must be >= 0"),
    (["--rehearsal", "-0.5"], "--rehearsal must be >= 0"),
    (["--eval_every", "5", "--eval_rooms", "0"], "--eval_every needs held-out inputs"),
    (["--tensorboard", "perhaps"], None),  # argparse's own error: exits
    # RFT sizes micro-batches by --batch_size rows (the step: --grad_accum of them) or by tokens, which regroups that
    # step: no row-count flag that packing would ignore
    (["--micro_batch_size", "4", "--max_tokens_per_micro_batch", "100"], None),
])
def test_bad_values_name_the_option(argv, msg):
    if msg is None:
        with pytest.raises(SystemExit):
            parse_config(RFTConfig, argv)
        return
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(")):
        parse_config(RFTConfig, argv)


def test_yaml_errors(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("kk: 1\n")
    with pytest.raises(ConfigError, match="unknown key\\(s\\) kk"):
        parse_config(RFTConfig, ["--config", str(y)])
    y.write_text("- a\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        parse_config(RFTConfig, ["--config", str(y)])
    with pytest.raises(ConfigError, match="no such file"):
        parse_config(RFTConfig, ["--config", str(tmp_path / "none.yaml")])


def test_base_config_is_reusable():
    from dataclasses import dataclass

    @dataclass(kw_only=True)
    class Other(RunConfig):
        rollouts: int = 8

        def validate(self):
            super().validate()
            if self.rollouts < 2:
                raise ConfigError("--rollouts must be >= 2")

    assert parse_config(Other, ["--rollouts", "4", "--lr", "0.5"]).rollouts == 4
    with pytest.raises(ConfigError, match="rollouts"):
        parse_config(Other, ["--rollouts", "1"])


def test_missing_model_dir():
    with pytest.raises(ConfigError, match="--model /no/model: no such checkpoint directory"):
        parse_config(RFTConfig, ["--model", "/no/model"])


def _help(module: str) -> str:
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "PYTHONPATH": root}
    res = subprocess.run([sys.executable, "-m", module, "--help"], cwd=root, env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    return res.stdout


def _options(text: str) -> dict:
    """{an option's names: its help text} from argparse's help (continuation lines joined)."""
    import re

    out, current = {}, None
    for line in text.splitlines():
        m = re.match(r"^  (--?\S.*?)(?:\s{2,}(.*))?$", line)
        if m:
            current = m.group(1).strip()
            out[current] = (m.group(2) or "").strip()
        elif current and line.startswith(" " * 8) and line.strip():
            out[current] = (out[current] + " " + line.strip()).strip()
        else:
            current = None
    return out


@pytest.mark.parametrize("module, own, foreign", [
    ("livemoe.train.rft", ["--k", "--teacher", "--marker_weight", "--batching", "--grad_accum", "--max_len"],
     ["--num_generations", "--beta"]),
    ("livemoe.train.grpo", ["--num_generations", "--beta", "--loss_type"],
     ["--marker_weight", "--markers", "--batching", "--grad_accum", "--max_len", "--k", "--teacher"]),
])
def test_help_lists_each_own_option_once_with_what_it_does(module, own, foreign):
    import importlib

    text = _help(module)
    assert text.startswith(f"usage: livemoe {module.rsplit('.', 1)[1]} ")  # the console script's name for it
    opts = _options(text)
    cls = importlib.import_module(module + ".config").__dict__["GRPOConfig" if module == "livemoe.train.grpo" else "RFTConfig"]
    fields = list(options(cls).values())  # its own fields and its components' flags (GRPO's loss and reward)
    assert len(fields) > 40
    for f in fields:
        names = [k for k in opts if k.split()[0] == f"--{f.name}"]
        assert len(names) == 1, (f.name, names)
        help_ = opts[names[0]]
        assert len(help_) > 10, f"--{f.name} has no description"
        assert help_.count("(default") <= 1, help_
        if f.type is bool:  # booleans read --flag / --no_flag, not --flag [FLAG]
            assert names[0] == f"--{f.name} / --no_{f.name}"
    for name in own:
        assert any(k.split()[0] == name for k in opts), name
    for name in foreign:
        assert not any(k.split()[0] == name for k in opts), name


def test_boolean_flags_and_their_yaml_form(tmp_path):
    assert parse_config(RFTConfig, ["--no_progress"]).progress is False
    assert parse_config(RFTConfig, ["--tensorboard"]).tensorboard is True
    assert parse_config(RFTConfig, ["--progress", "false", "--tensorboard", "yes"]).tensorboard is True
    y = tmp_path / "c.yaml"
    y.write_text("progress: false\nskip_bad_lines: true\n")
    cfg = parse_config(RFTConfig, ["--config", str(y)])
    assert cfg.progress is False and cfg.skip_bad_lines is True
    assert parse_config(RFTConfig, ["--config", str(y), "--progress"]).progress is True  # flags win
    with pytest.raises(SystemExit):
        parse_config(RFTConfig, ["--no_progress", "true"])


def test_grpo_flags_fill_its_loss_and_reward_configs_and_save_flat(tmp_path):
    """--epsilon, --beta, --w_length, ... fill cfg.loss (PolicyLossConfig) and cfg.reward (RewardConfig); their
    defaults are the components' own (β's GRPO's own 0.01); config.yaml keeps the flat keys and reads back."""
    import yaml

    from livemoe.train.grpo.config import GRPOConfig
    from livemoe.train.losses import PolicyLossConfig
    from livemoe.train.rewards import RewardConfig

    default = parse_config(GRPOConfig, [])
    assert default.loss == PolicyLossConfig(beta=0.01) == GRPOConfig().loss and default.reward == RewardConfig()
    cfg = parse_config(GRPOConfig, ["--epsilon", "0.3", "--beta", "0", "--loss_type", "dapo", "--w_length", "0.5",
                                    "--output_dir", str(tmp_path / "o")])
    assert cfg.loss == PolicyLossConfig(beta=0.0, epsilon_low=0.3, epsilon_high=0.3, loss_type="dapo")
    assert cfg.reward == RewardConfig(w_length=0.5)
    assert parse_config(GRPOConfig, ["--epsilon_high", "0.28"]).loss.epsilon_high == 0.28
    saved = yaml.safe_load(open(save_config(cfg, cfg.output_dir)))
    assert "loss" not in saved and "reward" not in saved
    assert (saved["epsilon"], saved["epsilon_high"], saved["beta"], saved["w_length"]) == (0.3, None, 0.0, 0.5)
    assert parse_config(GRPOConfig, ["--config", str(tmp_path / "o" / "config.yaml")]) == cfg
    assert "epsilon_high" in format_config(cfg) and "loss " not in format_config(cfg)
    # --micro_batch_size is resolved in validate(): 32 by default, None (and saved so) with token-balanced packing
    assert default.micro_batch_size == 32
    packed = parse_config(GRPOConfig, ["--max_tokens_per_micro_batch", "512", "--output_dir", str(tmp_path / "p")])
    assert packed.micro_batch_size is None
    assert parse_config(GRPOConfig, ["--config", save_config(packed, packed.output_dir)]) == packed


def test_config_yaml_records_the_parallel_layout(tmp_path):
    """config.yaml of a torchrun run heads with the mesh (parallel.json: world size, EP and DP degrees) as comments,
    and still reads back as the same options."""
    import json

    from livemoe.train.grpo.config import GRPOConfig

    cfg = parse_config(GRPOConfig, ["--output_dir", str(tmp_path / "o"), "--beta", "0.02"])
    (tmp_path / "o").mkdir()
    mesh = {"world_size": 4, "expert_parallel": 2, "data_parallel": 4, "expert_data_parallel": 2}
    (tmp_path / "o" / "parallel.json").write_text(json.dumps(mesh))
    text = open(save_config(cfg, cfg.output_dir)).read()
    assert "#   world_size: 4\n#   expert_parallel: 2\n" in text
    assert parse_config(GRPOConfig, ["--config", str(tmp_path / "o" / "config.yaml")]) == cfg


def test_live_flags_fill_its_stages_configs():
    """--sft_lr fills cfg.msft.lr, --gspo_balance cfg.gspo.balance, --lambda_aux both stages'; a stage's bad value
    is named by its flag."""
    from livemoe.train.live.config import LiveConfig
    from livemoe.train.live.gspo import GSPOOptions
    from livemoe.train.live.msft import MSFTOptions

    default = parse_config(LiveConfig, [])
    assert default.msft == MSFTOptions() and default.gspo == GSPOOptions()
    cfg = parse_config(LiveConfig, ["--sft_lr", "0.01", "--gspo_balance", "0.5", "--lambda_aux", "0.02",
                                    "--max_message_chars", "24", "--sft_steps", "3"])
    assert (cfg.msft.lr, cfg.msft.steps, cfg.gspo.balance, cfg.gspo.max_message_chars) == (0.01, 3, 0.5, 24)
    assert cfg.msft.lambda_aux == cfg.gspo.lambda_aux == 0.02 and cfg.msft.balance == MSFTOptions().balance
    assert set(options(LiveConfig)) == set(  # the flags it has always had, each once
        "model stage data eval_data replay output_dir results seed device threads progress train_sessions "
        "gspo_sessions eval_sessions num_intervals unrecorded_courtesy max_message_chars sft_steps sft_lr "
        "sft_batch_size marker_weight recipient_weight balance compare_plain max_len gspo_steps gspo_lr "
        "sessions_per_step num_generations num_iterations gspo_temperature turn_weight credit gspo_balance "
        "gspo_scale_rewards lambda_aux media_mode media_cache train_projector".split())
    assert cfg.msft.train_projector is cfg.gspo.train_projector is False  # one flag for both stages, off
    for argv, message in ((["--sft_lr", "0"], "--sft_lr must be > 0"), (["--gspo_lr", "-1"], "--gspo_lr must be > 0"),
                          (["--lambda_aux", "-1"], "--lambda_aux must be >= 0"),
                          (["--max_message_chars", "0"], "--max_message_chars must be >= 1")):
        with pytest.raises(ConfigError, match=message):
            parse_config(LiveConfig, argv)


def test_grpo_rollout_speculative_config_is_checked_when_parsed():
    from livemoe.train.grpo.config import GRPOConfig

    spec = '{"method": "ngram", "num_speculative_tokens": 4}'
    assert parse_config(GRPOConfig, ["--rollout_speculative_config", spec]).rollout_speculative_config == spec
    with pytest.raises(ConfigError, match="--rollout_speculative_config: speculative_config: unknown key"):
        parse_config(GRPOConfig, ["--rollout_speculative_config", '{"method": "ngram", "k": 4}'])
    with pytest.raises(ConfigError, match="with --rollout_url start the servers with --speculative-config"):
        parse_config(GRPOConfig, ["--rollout_speculative_config", spec, "--rollout_url", "http://h:1"])
