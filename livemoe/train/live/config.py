"""LiveConfig: the options of `python -m train.live`, parsed by livemoe.train.config's machinery (every option a
--flag, --config YAML with the same keys). The two stages' options are their own configs, fields of this one
(cfg.msft: MSFTOptions, cfg.gspo: GSPOOptions), each with its defaults and checks, filled by the flat flags they
have always had (--sft_lr fills cfg.msft.lr, --gspo_balance cfg.gspo.balance, --lambda_aux both)."""
import json
import os
import shutil
from dataclasses import dataclass, field

from livemoe.train.config import DEFAULT_STUDENT, ConfigError, check_at_least, check_choice, flag, nested
from livemoe.train.live.data import has_media, load_sessions
from livemoe.train.live.gspo import GSPOOptions
from livemoe.train.live.msft import MSFTOptions


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
    media_mode: str | None = field(default=None, metadata={
        "help": "the synthetic world heard and seen (livemoe/train/live/media_world.py, needs espeak-ng and a "
                "Qwen3-Omni-MoE thinker as --model): both | said (a change only spoken) | shown (only on a card); "
                "none = the text world"})
    media_cache: str = field(default="runs/live/media", metadata={"help": "where --media_mode keeps the speech and "
                                                                          "cards it renders"})
    compare_plain: bool = field(default=False, metadata={"help": "also train plain multi-turn SFT (marker weight 1, "
                                                                 "no balancing) from the same start, as a table "
                                                                 "row (doubles the SFT time)"})
    # MA-MSFT (livemoe.train.live.msft.MSFTOptions, its defaults and checks; the trainer sets its seed: --seed)
    msft: MSFTOptions = nested(
        MSFTOptions,
        sft_steps=flag(to="steps"),
        sft_lr=flag(to="lr"),
        sft_batch_size=flag(to="batch_size"),
        marker_weight=flag("loss weight of marker/field tokens (1 = plain)"),
        recipient_weight=flag("loss weight of the recipient name's tokens (1 = plain)"),
        balance=flag("class balancing of decisions by kind, 0 (none) .. 1 (full)"),
        max_len=flag(),
        lambda_aux=flag(),  # one flag for both stages
        train_projector=flag("Qwen3-Omni-MoE thinker: also train the encoders' projectors (the audio output "
                             "projection, the vision mergers); the encoders stay frozen (livemoe/train/live/omni.py)"))
    # SM-GSPO (livemoe.train.live.gspo.GSPOOptions, likewise)
    gspo: GSPOOptions = nested(
        GSPOOptions,
        max_message_chars=flag("longest MEM note / ANS message the grammar allows"),  # the evaluation's too
        gspo_steps=flag(to="steps"),
        gspo_lr=flag(to="lr"),
        sessions_per_step=flag(),
        num_generations=flag(),
        num_iterations=flag(),
        gspo_temperature=flag(to="temperature"),
        turn_weight=flag("advantage = w * turn + (1 - w) * trajectory credit"),
        credit=flag("the parts of a decision credited apart, each by its own reward: turn (whole decision) | head "
                    "(marker+fields, message) | field (marker, recipient, task, message; livemoe/train/live/gspo.py)"),
        gspo_balance=flag("SM-GSPO: advantages scaled by the class weight of the gold decision (kind, and an ANS's "
                          "task), 0 (none) .. 1 (full)", to="balance"),
        gspo_scale_rewards=flag("SM-GSPO advantages: group (centred, divided by the group's std) | batch | none "
                                "(centred only)", to="scale_rewards"),
        lambda_aux=flag(),
        train_projector=flag())

    def validate(self) -> None:
        """The options of its own; the stages' options checked theirs when they were made."""
        check_choice("stage", self.stage, ("sft", "gspo", "all"))
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
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
        check_at_least(self, 1, "train_sessions", "eval_sessions", "num_intervals")
        check_at_least(self, 0, "threads")
        self._check_media()

    def _check_media(self) -> None:
        """What a text checkpoint cannot do, and what --media_mode needs, refused before anything loads."""
        from livemoe.train.live.media_world import MODES

        if self.media_mode is not None:
            check_choice("media_mode", self.media_mode, MODES)
            if self.data or self.eval_data:
                raise ConfigError("--media_mode renders the synthetic world; --data / --eval_data sessions bring "
                                  "their own audio and video events")
            if shutil.which("espeak-ng") is None:
                raise ConfigError("--media_mode speaks the host's lines with espeak-ng, which is not installed "
                                  "(apt-get install espeak-ng)")
        text_model = not checkpoint_takes_media(self.model)
        if text_model and self.msft.train_projector:
            raise ConfigError(f"--train_projector: --model {self.model} is a text checkpoint (no audio or vision "
                              "encoder, so no projector); it needs a Qwen3-Omni-MoE thinker")
        if text_model and self.media_mode is not None:
            raise ConfigError(f"--media_mode {self.media_mode}: --model {self.model} is a text checkpoint, which "
                              "cannot hear or see; it needs a Qwen3-Omni-MoE thinker")
        if text_model:
            for name in ("data", "eval_data"):
                path = getattr(self, name)
                if path is not None and has_media(load_sessions(path)):
                    raise ConfigError(f"--{name} {path} has audio / video events; --model {self.model} is a text "
                                      "checkpoint, which cannot take them (a Qwen3-Omni-MoE thinker can; or give "
                                      "the text model transcripts and frame captions)")


def checkpoint_takes_media(path: str) -> bool:
    """Whether the checkpoint at path is a Qwen3-Omni-MoE thinker (from its config.json's model_type)."""
    from livemoe.engine.model.omni.config import OMNI_MODEL_TYPES

    try:
        with open(os.path.join(path, "config.json")) as f:
            return json.load(f).get("model_type") in OMNI_MODEL_TYPES
    except (OSError, ValueError, AttributeError):
        return False  # the loader names what is wrong with it
