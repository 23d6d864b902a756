"""Where a GRPO run starts: its checkpoint (--model, or for `auto` the RFT default's student, running the RFT
default first when it is missing) and its records (RFT's inputs)."""
import os

from livemoe.train.checkpoint import latest_checkpoint
from livemoe.train.config import ConfigError
from livemoe.train.data import load_inputs
from livemoe.train.grpo.config import GRPOConfig
from livemoe.train.rft.config import RFTConfig


def _model_dir(root: str):
    """A checkpoint directory at or under root (final export, model/, root itself, latest checkpoint)."""
    cands = [os.path.join(root, n) for n in ("final", "model", "export", "student")] + [root]
    last = latest_checkpoint(root) if os.path.isdir(root) else None
    cands += [os.path.join(last, "model")] if last else []
    return next((c for c in cands if os.path.isfile(os.path.join(c, "config.json"))), None)


def resolve_start(cfg: GRPOConfig) -> str:
    """--model, or for `auto` the RFT default's student (running the RFT default first if missing)."""
    if cfg.model != "auto":
        return cfg.model
    root = cfg.rft_output or RFTConfig().output_dir
    found = _model_dir(root)
    if found:
        return found
    try:
        from livemoe.train.rft import __main__ as rft
    except ImportError as e:
        raise ConfigError(f"--model auto: no RFT student under {root} and livemoe.train.rft cannot run ({e}); "
                          "pass --model CHECKPOINT_DIR") from None
    print(f"no RFT student under {root}: running the RFT default first (livemoe.train.rft)", flush=True)
    rc = rft.main(["--output_dir", root])
    if rc:
        raise ConfigError(f"--model auto: the RFT default failed (exit {rc}); pass --model CHECKPOINT_DIR")
    found = _model_dir(root)
    if not found:
        raise ConfigError(f"--model auto: the RFT default ran but left no checkpoint under {root}; "
                          "pass --model or --rft_output")
    return found


def load_records(cfg: GRPOConfig) -> tuple:
    """(training records, held-out records): RFT's inputs (the same synthetic rooms by default)."""
    train, held_out = load_inputs(cfg)
    if cfg.multi_turn and not any(r.get("followups") for r in train):
        raise ConfigError("--multi_turn: no training record has `followups` (later user turns)")
    return train, held_out
