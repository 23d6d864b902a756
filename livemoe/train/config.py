"""Typed run configs: every option is a `--flag`, `--config file.yaml` takes the same keys, flags win.

`RunConfig` holds what every trainer shares (model, data, optimiser, checkpoints, judge, eval);
livemoe.train.rft.config.RFTConfig adds the teacher, the selection and the SFT options. A trainer subclasses
RunConfig (as RFT and GRPO do) and gets the same parsing, `--help`, printing, saving and validation for free:
`parse_config(RFTConfig, argv, prog="python -m train.rft")`. Every field carries its one-line help
(`opt(default, help)`); booleans are `--flag` / `--no_flag` (or `--flag true|false`, as YAML has them).

A component's config (the policy loss's, the reward's, a live stage's) is a field of the trainer's, as
torchtitan's Trainer.Config holds its components': `loss: PolicyLossConfig = nested(PolicyLossConfig,
epsilon=flag("...", to="epsilon_low"), ...)`. The component owns its fields, defaults and checks; the trainer
names the flags that fill them, flat as they have always been (`--epsilon` fills cfg.loss.epsilon_low), and
--help, --config and config.yaml see only those flat options (config_dict). A component's bad value is a
ConfigError: its own message, or `--FLAG why` when it raises OptionError naming its field.
The trainer's own checks live in `validate()` and raise ConfigError.

Plain argparse rather than jsonargparse, tyro or HfArgumentParser: those give typed flags and --help
from dataclasses too, but each brings its own YAML merging and error path (a SystemExit, or its own
exception text), and names a nested field by its path (`--loss.epsilon_low`), while the trainers need one
path, defaults < YAML < flags, coerced by one function, every bad key or value a ConfigError naming the file
or flag (run_cli prints it as one line), and the flat flags their users know. That is the ~150 lines below.
"""
import argparse
import dataclasses
import json
import os
import shutil
import sys
import types
import typing
from dataclasses import MISSING, dataclass, field


DEFAULT_STUDENT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "student")


class ConfigError(ValueError):
    """A bad option: the message names it."""


class OptionError(ValueError):
    """A bad value of a component config's field: `option` names the field, so that a command line reports it
    under the flag that set it (`--gspo_balance must be in [0, 1]` for the SM-GSPO stage's `balance`)."""

    def __init__(self, option: str, why: str):
        super().__init__(f"{option} {why}")
        self.option, self.why = option, why


def opt(default, help: str, **kw):
    """A config field with its one-line --help text (every option has one: `--help` lists them all)."""
    return field(default=default, metadata={"help": help}, **kw)


class Flag(typing.NamedTuple):
    """A command-line flag that fills a field of a nested component config (see nested)."""
    help: str = ""
    to: str = ""  # the component's field it fills; "" = the one of the flag's own name
    default: object = MISSING  # MISSING = the component's own default
    none_means: str = ""  # a flag whose value this one takes when it is None (--epsilon_high: --epsilon)


def flag(help: str = "", *, to: str = "", default=MISSING, none_means: str = "") -> Flag:
    return Flag(help, to, default, none_means)


def nested(component, **flags: Flag):
    """A field holding a component's config, filled by the flat flags `flags` (name -> Flag); a flag that two
    components of one config name fills both (one --lambda_aux for both live stages)."""
    return field(default_factory=lambda: _component(component, flags, {}),
                 metadata={"component": component, "flags": flags})


def _component(component, flags: dict, values: dict):
    """component(...) from its flags' values: given in `values`, else the flag's default, else its own."""
    own = {f.name: f for f in dataclasses.fields(component)}
    given = {name: values.get(name, own[fl.to or name].default if fl.default is MISSING else fl.default)
             for name, fl in flags.items()}
    for name, fl in flags.items():
        if fl.none_means and given[name] is None:
            given[name] = given[fl.none_means]
    try:
        return component(**{fl.to or name: given[name] for name, fl in flags.items() if given[name] is not MISSING})
    except ValueError as e:
        names = [name for name, fl in flags.items() if isinstance(e, OptionError) and (fl.to or name) == e.option]
        raise ConfigError(f"--{names[0]} {e.why}" if names else str(e)) from None


@dataclass(kw_only=True)
class RunConfig:
    """options every trainer shares"""
    # what to train, on what, where
    model: str = opt(DEFAULT_STUDENT, "checkpoint directory to start from (default: the committed tiny student, "
                                      "livemoe/train/assets/student)")
    data: str | None = opt(None, "training JSONL (the seed's shape or MuSiQue's); none = synthetic live-commerce rooms")
    eval_data: str | None = opt(None, "held-out JSONL for the before/after table; none = synthetic held-out rooms "
                                      "(none with --data: no table)")
    output_dir: str = opt("runs/rft", "where the config, metrics, curves, checkpoints and final/ export go")
    seed: int = opt(0, "seed of the data order, sampling and initialisation")
    device: str = opt("auto", "auto (a GPU when there is one) | cpu | cuda")
    # 1 by default: on a shared 2-core CPU two threads per process oversubscribe it and run several times
    # slower (measured: 25.7 s vs 1.2 s for the same evaluation); with the CPU to itself two threads are 1.5-1.8x
    # faster with the same results (make demo passes --threads 2)
    threads: int = opt(1, "CPU threads for torch (0 = torch's default)")
    skip_bad_lines: bool = opt(False, "skip and count malformed JSONL lines instead of stopping at the first")
    train_rooms: int = opt(2048, "synthetic training inputs when --data is not given")
    eval_rooms: int = opt(64, "synthetic held-out rooms for the before/after table (0 = no table)")
    # optimisation
    lr: float = opt(2e-3, "learning rate after warm-up (suits the tiny student; the seed used 1.5e-6 at 30B)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    warmup_steps: int = opt(10, "optimizer steps of linear lr warm-up, then cosine decay to 0")
    max_steps: int = opt(0, "optimizer steps to run; 0 = --epochs passes over the data")
    epochs: float = opt(8.0, "passes over the training data when --max_steps is 0")
    batch_size: int = opt(8, "training examples per micro-batch")
    max_grad_norm: float = opt(1.0, "clip the gradient norm to this (0 = no clipping)")
    lambda_aux: float = opt(0.01, "MoE load-balancing loss weight, as in the seed")
    bf16: str = opt("auto", "bf16 compute: auto (on a GPU) | true | false")
    gradient_checkpointing: bool = opt(False, "recompute activations in the backward pass to save memory")
    expert_parallel: int = opt(1, "under torchrun: ranks that split each MoE layer's experts (divides the world "
                                  "size and num_experts)")
    # runs
    save_every: int = opt(0, "write a checkpoint every N steps (0 = only at the end)")
    keep_last: int = opt(2, "checkpoints kept on disk (older ones are deleted)")
    max_nonfinite_steps: int = opt(5, "stop the run (exit 2) after this many optimizer steps in a row with a "
                                      "NaN/Inf loss or gradient; each such step is skipped")
    resume: str = opt("none", "none | auto (the latest checkpoint in --output_dir) | a checkpoint directory")
    log_every: int = opt(1, "log and print metrics every N steps")
    tensorboard: bool = opt(False, "also write metrics for TensorBoard (<output_dir>/tensorboard)")
    progress: bool = opt(True, "progress bars and per-step lines")
    plot: bool = opt(True, "draw curves.png (and curves_more.png) from metrics.jsonl at the end")
    # judge and evaluation
    judge: str = opt("auto", "auto | synthetic | squad | llm | module:attr (your own judge)")
    judge_url: str | None = opt(None, "OpenAI-compatible endpoint of --judge llm")
    judge_model: str = opt("default", "model name at --judge_url, or a local checkpoint directory judged with "
                                      "the engine")
    judge_language: str = opt("en", "language of the LLM judge's prompts (the seed's Appendix B): en | zh")
    judge_api_key_env: str = opt("OPENAI_API_KEY", "environment variable holding the --judge_url API key")
    judge_concurrency: int = opt(8, "parallel requests to --judge_url")
    eval_max_new_tokens: int = opt(256, "token limit of each held-out response")
    # sampled, as reasoning models are evaluated (greedy decoding of a small model shows one mode of
    # its answers: the RFT student's greedy answer is its short one, while most of its samples copy
    # the teacher's long thoughts); 0 = greedy
    eval_temperature: float = opt(0.7, "held-out decoding temperature (the seed's τ); 0 = greedy")
    eval_samples: int = opt(4, "responses sampled per held-out prompt (1 when greedy)")

    def check_model(self) -> None:
        if not os.path.isdir(self.model):
            raise ConfigError(f"--model {self.model}: no such checkpoint directory")

    def validate(self) -> None:
        check_at_least(self, 1, "batch_size", "keep_last", "log_every", "eval_max_new_tokens", "eval_samples",
                       "max_nonfinite_steps", "expert_parallel")
        check_at_least(self, 0, "lr", "lambda_aux", "max_grad_norm", "weight_decay", "warmup_steps", "max_steps",
                       "save_every", "train_rooms", "eval_rooms", "eval_temperature", "threads")
        if self.eval_temperature == 0 and self.eval_samples != 1:
            raise ConfigError(f"--eval_samples {self.eval_samples} needs --eval_temperature > 0: greedy responses are "
                              "identical (use --eval_samples 1 with --eval_temperature 0)")
        if self.max_steps == 0 and self.epochs <= 0:
            raise ConfigError("--epochs must be > 0 when --max_steps is 0")
        check_choice("bf16", self.bf16, ("auto", "true", "false"))
        check_choice("device", self.device, ("auto", "cpu", "cuda"))
        check_choice("judge_language", self.judge_language, ("en", "zh"))
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


def check_at_least(cfg, low, *names: str) -> None:
    """ConfigError naming the first of the options `names` of cfg that is below `low`."""
    for name in names:
        if getattr(cfg, name) < low:
            raise ConfigError(f"--{name} must be >= {low}, got {getattr(cfg, name)}")


def check_speculative_config(name: str, value: str) -> None:
    """ConfigError naming --`name` when `value` is not an engine speculative_config (JSON, the engine's keys)."""
    from livemoe.engine.decoder.spec.config import SpeculativeConfig
    from livemoe.engine.errors import EngineConfigError

    try:
        SpeculativeConfig.parse(value)
    except EngineConfigError as e:
        raise ConfigError(f"--{name}: {e}") from None


def check_choice(name, value, choices):
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


class BoolFlag(argparse.Action):
    """A boolean option: `--flag` / `--no_flag`, and `--flag true|false` as YAML writes it."""

    def __init__(self, option_strings, dest, **kw):
        negated = ["--no_" + s[2:] for s in option_strings]
        super().__init__(option_strings + negated, dest, nargs="?", metavar="", **kw)

    def __call__(self, parser, namespace, value, option_string=None):
        if option_string.startswith("--no_"):
            if value is not None:
                parser.error(f"{option_string} takes no value")
            setattr(namespace, self.dest, False)
            return
        try:
            setattr(namespace, self.dest, True if value is None else _to_bool(value))
        except argparse.ArgumentTypeError as e:
            parser.error(f"{option_string}: {e}")


class _HelpFormatter(argparse.HelpFormatter):
    """One line of names per option: `--lr LR`, `--progress / --no_progress`."""

    def __init__(self, prog):
        super().__init__(prog, max_help_position=32, width=min(120, shutil.get_terminal_size().columns))

    def _format_action_invocation(self, action):
        if isinstance(action, BoolFlag):
            return " / ".join(action.option_strings)
        return super()._format_action_invocation(action)


def _field_help(cls, name: str) -> str:
    """A field's help; a subclass that only changes a default keeps its base class's text."""
    for klass in cls.__mro__:
        f = getattr(klass, "__dataclass_fields__", {}).get(name)
        if f is not None and f.metadata.get("help"):
            return f.metadata["help"]
    return ""


@dataclass(frozen=True)
class Option:
    """One option of a config class: a field of its own, or a flag of one of its nested components."""
    name: str
    type: type  # int / float / str / bool
    default: object
    help: str
    group: type  # the class whose group of --help lists it


def options(cls) -> dict:
    """name -> Option, in the order --help lists them: the fields of cls, each nested component's flags in its
    place. A field's group is the most basic class that declares it (an overridden default stays in its group)."""
    hints, out = typing.get_type_hints(cls), {}
    for f in dataclasses.fields(cls):
        group = next(k for k in reversed(cls.__mro__) if f.name in getattr(k, "__dataclass_fields__", {}))
        if "component" not in f.metadata:
            out[f.name] = Option(f.name, _base_type(hints[f.name]), f.default, _field_help(cls, f.name), group)
            continue
        component = f.metadata["component"]
        own, types_ = {x.name: x for x in dataclasses.fields(component)}, typing.get_type_hints(component)
        for name, fl in f.metadata["flags"].items():
            to = fl.to or name
            o = Option(name, _base_type(types_[to]), own[to].default if fl.default is MISSING else fl.default,
                       fl.help, group)
            if name in out:  # one flag of two components
                assert (out[name].type, out[name].default) == (o.type, o.default), f"--{name}: two defaults"
                continue
            out[name] = o
    return out


def _default_text(default) -> str:
    if default is None or default is MISSING:
        return ""  # the help says what leaving it out means
    if isinstance(default, bool):
        return "true" if default else "false"
    return str(default)


def build_parser(cls, description: str = "", prog: str | None = None) -> argparse.ArgumentParser:
    """--help lists each option once, in groups: the options every trainer shares, then the trainer's own."""
    ap = argparse.ArgumentParser(prog=prog, description=description, argument_default=argparse.SUPPRESS,
                                 formatter_class=_HelpFormatter,
                                 usage=f"{prog or '%(prog)s'} [-h] [--config FILE.yaml] [--OPTION VALUE ...]")
    ap.add_argument("--config", metavar="FILE.yaml", help="YAML file with the same keys as the options (flags win)")
    groups = {}
    for o in options(cls).values():
        if o.group not in groups:
            groups[o.group] = ap.add_argument_group((o.group.__doc__ or o.group.__name__).strip())
        help_, default = o.help, _default_text(o.default)
        if default and "(default" not in help_:
            help_ = f"{help_} (default: {default})"
        if o.type is bool:
            groups[o.group].add_argument(f"--{o.name}", action=BoolFlag, help=help_)
        else:
            groups[o.group].add_argument(f"--{o.name}", type=str, help=help_,
                                         metavar={int: "INT", float: "FLOAT"}.get(o.type, "TEXT"))
    return ap


def parse_config(cls, argv=None, description: str = "", prog: str | None = None):
    """cls from defaults < --config YAML < flags, validated. Raises ConfigError on any bad key or value."""
    args = vars(build_parser(cls, description, prog).parse_args(argv))
    values = {}
    path = args.pop("config", None)
    opts = options(cls)
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
        unknown = sorted(set(loaded) - set(opts))
        if unknown:
            raise ConfigError(f"--config {path}: unknown key(s) {', '.join(unknown)}")
        values.update({k: _coerce(k, opts[k].type, v, path) for k, v in loaded.items()})
    values.update({k: _coerce(k, opts[k].type, v, "flag --" + k) for k, v in args.items()})
    cfg = build_config(cls, values)
    cfg.validate()
    return cfg


def build_config(cls, values: dict):
    """cls from flat option values (name -> value; the others take their defaults): its own fields by name, each
    nested component from its flags. Not validated (parse_config validates)."""
    kw = {}
    for f in dataclasses.fields(cls):
        if "component" in f.metadata:
            kw[f.name] = _component(f.metadata["component"], f.metadata["flags"], values)
        elif f.name in values:
            kw[f.name] = values[f.name]
    return cls(**kw)


def config_dict(cfg) -> dict:
    """The options of cfg, flat (name -> value, as --help lists them): what config.yaml holds and --config
    reads back into the same config. A flag with none_means is None where it equals that flag."""
    out = {}
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if "component" not in f.metadata:
            out[f.name] = value
            continue
        flags = f.metadata["flags"]
        own = {name: getattr(value, fl.to or name) for name, fl in flags.items()}
        for name, fl in flags.items():
            out.setdefault(name, None if fl.none_means and own[name] == own[fl.none_means] else own[name])
    return out


def format_config(cfg) -> str:
    width = max(len(k) for k in config_dict(cfg))
    return "\n".join(f"  {k:<{width}} : {v}" for k, v in config_dict(cfg).items())


def save_config(cfg, output_dir: str) -> str:
    """Writes the resolved config as config.yaml (the same keys --config reads back). The run's parallel layout
    (parallel.json, which the trainer's set-up writes first: world size, expert and data parallel degrees) heads
    it as comments: recorded with the options, and not one of them (a resumed run takes its own from torchrun)."""
    import yaml

    os.makedirs(output_dir, exist_ok=True)
    path = os.path.join(output_dir, "config.yaml")
    layout = os.path.join(output_dir, "parallel.json")
    with open(path + ".tmp", "w") as f:
        if os.path.isfile(layout):
            with open(layout) as g:
                mesh = json.load(g)
            f.write("# parallel layout of this run (parallel.json; set by torchrun, not an option):\n")
            f.write("".join(f"#   {k}: {v}\n" for k, v in mesh.items()))
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
