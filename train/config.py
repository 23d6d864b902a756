"""Typed run configs: every field is a `--flag`, `--config file.yaml` takes the same keys, flags win.

`RunConfig` holds what every trainer shares (model, data, optimiser, checkpoints, judge, eval);
`RFTConfig` adds the teacher and the selection. A trainer subclasses RunConfig (as GRPO does) and
gets the same parsing, printing, saving and validation for free: `parse_config(RFTConfig, argv)`.
All user-facing checks live in `validate()` and raise ConfigError.
"""
import argparse
import dataclasses
import json
import os
import sys
import types
import typing
from dataclasses import dataclass, field


DEFAULT_STUDENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "student")


class ConfigError(ValueError):
    """A bad option: the message names it."""


@dataclass(kw_only=True)
class RunConfig:
    # what to train, on what, where
    model: str = field(default=DEFAULT_STUDENT, metadata={"help": "checkpoint directory to start from "
                                                                 "(default: the committed tiny student)"})
    data: str | None = field(default=None, metadata={"help": "JSONL (seed shape or MuSiQue); none = synthetic rooms"})
    eval_data: str | None = field(default=None, metadata={"help": "held-out JSONL; none = synthetic held-out rooms"})
    output_dir: str = "runs/rft"
    seed: int = 0
    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda"})
    # 1 by default: the tiny default model gains little from a second thread, and on a shared 2-core CPU
    # two threads per process oversubscribe it and run several times slower (measured: 25.7 s vs 1.2 s
    # for the same evaluation)
    threads: int = field(default=1, metadata={"help": "CPU threads for torch (0 = torch's default)"})
    skip_bad_lines: bool = field(default=False, metadata={"help": "skip and count malformed JSONL lines"})
    train_rooms: int = field(default=2048, metadata={"help": "synthetic training inputs when --data is not given"})
    eval_rooms: int = field(default=64, metadata={"help": "synthetic held-out rooms for the before/after table"})
    # optimisation
    lr: float = 2e-3  # the tiny default student; the seed used 1.5e-6 at 30B
    weight_decay: float = 0.0
    warmup_steps: int = 10
    max_steps: int = 0  # 0: run `epochs` over the data
    epochs: float = 8.0
    batch_size: int = 8
    grad_accum: int = 1
    max_grad_norm: float = 1.0
    lambda_aux: float = field(default=0.01, metadata={"help": "MoE load-balancing loss weight (seed: 0.01)"})
    marker_weight: float = field(default=1.0, metadata={"help": "loss weight of marker tokens (1 = plain SFT)"})
    markers: str = field(default="<think>,</think>", metadata={"help": "comma-separated marker strings"})
    max_len: int = 1024
    batching: str = field(default="bucket", metadata={"help": "bucket (length-bucketed) | pad (shuffled)"})
    bf16: str = field(default="auto", metadata={"help": "auto (on a GPU) | true | false"})
    gradient_checkpointing: bool = False
    # runs
    save_every: int = 0  # 0: only at the end
    keep_last: int = 2
    resume: str = field(default="none", metadata={"help": "none | auto | a checkpoint directory"})
    log_every: int = 1
    tensorboard: bool = False
    progress: bool = True
    # judge and evaluation
    judge: str = field(default="auto", metadata={"help": "auto | synthetic | squad | llm | module:attr"})
    judge_url: str | None = None
    judge_model: str = field(default="default", metadata={"help": "model name at --judge_url, or a local "
                                                                   "checkpoint directory judged with the engine"})
    judge_language: str = "en"
    judge_api_key_env: str = "OPENAI_API_KEY"
    judge_concurrency: int = 8
    eval_max_new_tokens: int = 256
    # sampled, as reasoning models are evaluated (greedy decoding of a small model shows one mode of
    # its answers: the RFT student's greedy answer is its short one, while most of its samples copy
    # the teacher's long thoughts); 0 = greedy
    eval_temperature: float = field(default=0.7, metadata={"help": "held-out decoding temperature (the seed's τ); 0 = greedy"})
    eval_samples: int = field(default=4, metadata={"help": "responses sampled per held-out prompt (1 when greedy)"})

    def check_model(self) -> None:
        if not os.path.isdir(self.model):
            raise ConfigError(f"--model {self.model}: no such checkpoint directory")

    def validate(self) -> None:
        positive = ["batch_size", "grad_accum", "max_len", "keep_last", "log_every", "eval_max_new_tokens", "eval_samples"]
        for name in positive:
            if getattr(self, name) < 1:
                raise ConfigError(f"--{name} must be >= 1, got {getattr(self, name)}")
        for name in ("lr", "lambda_aux", "max_grad_norm", "weight_decay", "warmup_steps", "max_steps",
                     "save_every", "train_rooms", "eval_rooms", "eval_temperature", "threads"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name} must be >= 0, got {getattr(self, name)}")
        if self.eval_temperature == 0 and self.eval_samples != 1:
            raise ConfigError(f"--eval_samples {self.eval_samples} needs --eval_temperature > 0: greedy responses are "
                              "identical (use --eval_samples 1 with --eval_temperature 0)")
        if self.max_steps == 0 and self.epochs <= 0:
            raise ConfigError("--epochs must be > 0 when --max_steps is 0")
        if self.marker_weight <= 0:
            raise ConfigError(f"--marker_weight must be > 0, got {self.marker_weight}")
        _choice("batching", self.batching, ("bucket", "pad"))
        _choice("bf16", self.bf16, ("auto", "true", "false"))
        _choice("device", self.device, ("auto", "cpu", "cuda"))
        _choice("judge_language", self.judge_language, ("en", "zh"))
        if self.resume not in ("none", "auto") and not os.path.isdir(self.resume):
            raise ConfigError(f"--resume {self.resume!r}: expected none, auto or an existing checkpoint directory")
        self.check_model()
        if self.data and not os.path.isfile(self.data):
            raise ConfigError(f"--data {self.data}: no such file")
        if self.eval_data and not os.path.isfile(self.eval_data):
            raise ConfigError(f"--eval_data {self.eval_data}: no such file")
        if self.judge == "llm" and not self.judge_url and not os.path.isdir(self.judge_model):
            raise ConfigError("--judge llm needs --judge_url (an OpenAI-compatible endpoint) or --judge_model "
                              "naming a local checkpoint directory")


@dataclass(kw_only=True)
class RFTConfig(RunConfig):
    teacher: str = field(default="scripted", metadata={"help": "scripted | a checkpoint directory | an http(s) URL"})
    teacher_model: str = field(default="default", metadata={"help": "model name sent to a --teacher URL"})
    teacher_api_key_env: str = "OPENAI_API_KEY"
    k: int = field(default=4, metadata={"help": "teacher samples per input (seed: 4)"})
    temperature: float = field(default=0.7, metadata={"help": "teacher sampling temperature (seed: 0.7)"})
    teacher_max_new_tokens: int = 384
    teacher_concurrency: int = 8
    teacher_retries: int = 3
    teacher_timeout_s: float = 120.0
    wrong_link_rate: float = field(default=0.25, metadata={"help": "scripted teacher: wrong-link answers"})
    deflect_rate: float = field(default=0.2, metadata={"help": "scripted teacher: bare deflections"})
    verbose_rate: float = field(default=0.6, metadata={"help": "scripted teacher: long meta-reasoning thoughts"})
    selection: str = field(default="first", metadata={"help": "first | random | shortest passing candidate"})
    expert_parallel: int = field(default=1, metadata={"help": "under torchrun: ranks that split each MoE layer's "
                                                              "experts (divides the world size and num_experts)"})

    def validate(self) -> None:
        super().validate()
        if self.k < 1:
            raise ConfigError(f"--k must be >= 1, got {self.k}")
        if self.expert_parallel < 1:
            raise ConfigError(f"--expert_parallel must be >= 1, got {self.expert_parallel}")
        if self.temperature < 0:
            raise ConfigError(f"--temperature must be >= 0, got {self.temperature}")
        for name in ("wrong_link_rate", "deflect_rate", "verbose_rate"):
            if not 0 <= getattr(self, name) <= 1:
                raise ConfigError(f"--{name} must be in [0, 1], got {getattr(self, name)}")
        if self.wrong_link_rate + self.deflect_rate > 1:
            raise ConfigError("--wrong_link_rate + --deflect_rate must be <= 1")
        _choice("selection", self.selection, ("first", "random", "shortest"))
        if self.teacher not in ("scripted",) and not self.teacher.startswith(("http://", "https://")) \
                and not os.path.isdir(self.teacher):
            raise ConfigError(f"--teacher {self.teacher!r}: expected scripted, an http(s) URL or a checkpoint directory")


def _choice(name, value, choices):
    if value not in choices:
        raise ConfigError(f"--{name} must be one of {', '.join(choices)}; got {value!r}")


def _base_type(tp):
    """int / float / str / bool of a field annotation (Optional[...] unwrapped)."""
    if isinstance(tp, str):
        tp = eval(tp, vars(typing))  # noqa: S307 -- annotations of this module only
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        tp = next(a for a in typing.get_args(tp) if a is not type(None))
    return tp


def _to_bool(s) -> bool:
    if isinstance(s, bool):
        return s
    v = str(s).strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {s!r}")


def _coerce(name: str, tp, value, where: str):
    if value is None:
        return None
    try:
        if tp is bool:
            return _to_bool(value)
        if tp is int and isinstance(value, float) and not value.is_integer():
            raise ValueError
        return tp(value)
    except (ValueError, TypeError, argparse.ArgumentTypeError):
        raise ConfigError(f"{where}: {name} must be {tp.__name__}, got {value!r}") from None


def build_parser(cls, description: str = "") -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description, argument_default=argparse.SUPPRESS)
    ap.add_argument("--config", help="YAML file with the same keys as the flags (flags win)")
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = _base_type(hints[f.name])
        help_ = f"{f.metadata.get('help', '')} (default: {f.default})".strip()
        if tp is bool:
            ap.add_argument(f"--{f.name}", type=_to_bool, nargs="?", const=True, help=help_)
        else:
            ap.add_argument(f"--{f.name}", type=str, help=help_)
    return ap


def parse_config(cls, argv=None, description: str = ""):
    """cls from defaults < --config YAML < flags, validated. Raises ConfigError on any bad key or value."""
    args = vars(build_parser(cls, description).parse_args(argv))
    values = {}
    path = args.pop("config", None)
    names = {f.name for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    if path:
        import yaml

        if not os.path.isfile(path):
            raise ConfigError(f"--config {path}: no such file")
        try:
            with open(path) as f:
                loaded = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"--config {path}: not valid YAML ({e})") from None
        if not isinstance(loaded, dict):
            raise ConfigError(f"--config {path}: expected a mapping of option: value")
        unknown = sorted(set(loaded) - names)
        if unknown:
            raise ConfigError(f"--config {path}: unknown key(s) {', '.join(unknown)}")
        values.update({k: _coerce(k, _base_type(hints[k]), v, path) for k, v in loaded.items()})
    values.update({k: _coerce(k, _base_type(hints[k]), v, "flag --" + k) for k, v in args.items()})
    cfg = cls(**values)
    cfg.validate()
    return cfg


def config_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def format_config(cfg) -> str:
    width = max(len(k) for k in config_dict(cfg))
    return "\n".join(f"  {k:<{width}} : {v}" for k, v in config_dict(cfg).items())


def save_config(cfg, output_dir: str) -> str:
    """Writes the resolved config as config.yaml (the same keys --config reads back)."""
    import yaml

    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "config.yaml")
    with open(path + ".tmp", "w") as f:
        yaml.safe_dump(json.loads(json.dumps(config_dict(cfg))), f, sort_keys=False)
    os.replace(path + ".tmp", path)
    return path


def run_cli(body) -> int:
    """Runs a trainer command's body: bad input of any kind (ConfigError, DataError, CheckpointError, ...
    all ValueErrors, or an OSError) is one clear line and exit code 2, never a traceback; Ctrl-C keeps
    the last complete checkpoint."""
    try:
        body()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: the last complete checkpoint is kept; continue with --resume auto", file=sys.stderr)
        return 130
    return 0
