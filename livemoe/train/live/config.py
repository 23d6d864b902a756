"""LiveConfig: the options of `python -m train.live`, typed and validated in one place (ConfigError),
parsed by livemoe.train.config's machinery (every field a --flag, --config YAML with the same keys)."""
import os
from dataclasses import dataclass, field

from livemoe.train.advantages import SCALE_REWARDS
from livemoe.train.config import DEFAULT_STUDENT, ConfigError, check_choice, default_of
from livemoe.train.live.gspo import CREDITS, GSPOOptions
from livemoe.train.live.msft import MSFTOptions
from livemoe.train.live.options import StageOptions


@dataclass(kw_only=True)
class LiveConfig:
    """the world, MA-MSFT and SM-GSPO (defaults of the training options: livemoe.train.live.msft / livemoe.train.live.gspo)"""
    model: str = field(default=DEFAULT_STUDENT, metadata={"help": "checkpoint to start from (default: the "
                                                                 "committed tiny student)"})
    stage: str = field(default="all", metadata={"help": "sft (MA-MSFT) | gspo (SM-GSPO from --model) | all"})
    data: str | None = field(default=None, metadata={"help": "training sessions, JSONL (livemoe/train/live/data.py); "
                                                            "none = the synthetic world"})
    eval_data: str | None = field(default=None, metadata={"help": "held-out sessions, JSONL; none = synthetic"})
    replay: str | None = field(default=None, metadata={"help": "a checkpoint: play one held-out session through "
                                                              "a LiveSession, printing each interval, and exit"})
    output_dir: str = "runs/live"
    results: str | None = field(default=None, metadata={"help": "also write the results JSON here"})
    seed: int = 0
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    threads: int = field(default=1, metadata={"help": "CPU threads for torch (0 = torch's default)"})
    progress: bool = True
    # the synthetic world
    train_sessions: int = 512
    gspo_sessions: int = field(default=0, metadata={"help": "SM-GSPO's own pool: this many fresh sessions of the "
                                                            "synthetic world, none of them seen by MA-MSFT "
                                                            "(0 = MA-MSFT's training sessions)"})
    eval_sessions: int = 64
    num_intervals: int = field(default=6, metadata={"help": "intervals per synthetic session (10 s each)"})
    unrecorded_courtesy: float | None = field(default=None, metadata={
        "help": "synthetic world: the chance that the recorded trajectory MA-MSFT imitates leaves out a welcome "
                "or thank the reviewed decision makes (livemoe/train/live/world.py; none = the world's default)"})
    max_message_chars: int = field(default=default_of(GSPOOptions, "max_message_chars"),
                                   metadata={"help": "longest MEM note / ANS message the grammar allows"})
    # MA-MSFT
    sft_steps: int = default_of(MSFTOptions, "steps")
    sft_lr: float = default_of(MSFTOptions, "lr")
    sft_batch_size: int = default_of(MSFTOptions, "batch_size")
    marker_weight: float = field(default=default_of(MSFTOptions, "marker_weight"),
                                 metadata={"help": "loss weight of marker/field tokens (1 = plain)"})
    recipient_weight: float = field(default=default_of(MSFTOptions, "recipient_weight"),
                                    metadata={"help": "loss weight of the recipient name's tokens (1 = plain)"})
    balance: float = field(default=default_of(MSFTOptions, "balance"),
                           metadata={"help": "class balancing of decisions by kind, 0 (none) .. 1 (full)"})
    compare_plain: bool = field(default=False, metadata={"help": "also train plain multi-turn SFT (marker weight 1, "
                                                                 "no balancing) from the same start, as a table "
                                                                 "row (doubles the SFT time)"})
    max_len: int = default_of(MSFTOptions, "max_len")
    # SM-GSPO
    gspo_steps: int = default_of(GSPOOptions, "steps")
    gspo_lr: float = default_of(GSPOOptions, "lr")
    sessions_per_step: int = default_of(GSPOOptions, "sessions_per_step")
    num_generations: int = default_of(GSPOOptions, "num_generations")
    num_iterations: int = default_of(GSPOOptions, "num_iterations")
    gspo_temperature: float = default_of(GSPOOptions, "temperature")
    turn_weight: float = field(default=default_of(GSPOOptions, "turn_weight"),
                               metadata={"help": "advantage = w * turn + (1 - w) * trajectory credit"})
    credit: str = field(default=default_of(GSPOOptions, "credit"),
                        metadata={"help": "the parts of a decision credited apart, each by its own reward: turn "
                                          "(whole decision) | head (marker+fields, message) | field (marker, "
                                          "recipient, task, message; livemoe/train/live/gspo.py)"})
    gspo_balance: float = field(default=default_of(GSPOOptions, "balance"),
                                metadata={"help": "SM-GSPO: advantages scaled by the class weight of the gold "
                                                  "decision (kind, and an ANS's task), 0 (none) .. 1 (full)"})
    gspo_scale_rewards: str = field(default=default_of(GSPOOptions, "scale_rewards"),
                                    metadata={"help": "SM-GSPO advantages: group (centred, divided by the group's "
                                                      "std) | batch | none (centred only)"})
    lambda_aux: float = default_of(StageOptions, "lambda_aux")  # one flag for both stages

    def validate(self) -> None:
        check_choice("stage", self.stage, ("sft", "gspo", "all"))
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        check_choice("credit", self.credit, CREDITS)
        check_choice("gspo_scale_rewards", self.gspo_scale_rewards, SCALE_REWARDS)
        for name, path in (("model", self.model), ("replay", self.replay)):
            if path is not None and not os.path.isdir(path):
                raise ConfigError(f"--{name} {path}: no such checkpoint directory")
        for name in ("data", "eval_data"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"--{name} {path}: no such file")
        if self.unrecorded_courtesy is not None:
            if self.data:
                raise ConfigError("--unrecorded_courtesy shapes the synthetic world's recordings; --data sessions "
                                  "bring their own (an interval's optional \"recorded\" decision)")
            if not 0 <= self.unrecorded_courtesy <= 1:
                raise ConfigError(f"--unrecorded_courtesy must be in [0, 1], got {self.unrecorded_courtesy}")
        if self.gspo_sessions < 0:
            raise ConfigError(f"--gspo_sessions must be >= 0, got {self.gspo_sessions}")
        if self.gspo_sessions and self.data:
            raise ConfigError("--gspo_sessions draws fresh sessions of the synthetic world; with --data SM-GSPO "
                              "plays the --data sessions (drop one of the two)")
        for name in ("train_sessions", "eval_sessions", "num_intervals", "sft_steps", "sft_batch_size", "max_len",
                     "gspo_steps", "sessions_per_step", "num_iterations", "max_message_chars"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        if self.num_generations < 2:
            raise ConfigError(f"--num_generations must be >= 2 (advantages compare them), got {self.num_generations}")
        for name in ("sft_lr", "gspo_lr", "gspo_temperature", "marker_weight", "recipient_weight"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"--{name} must be > 0, got {getattr(self, name)}")
        for name in ("balance", "gspo_balance", "turn_weight"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"--{name} must be in [0, 1], got {getattr(self, name)}")
        if self.threads < 0 or self.lambda_aux < 0:
            raise ConfigError("--threads and --lambda_aux must be >= 0")
