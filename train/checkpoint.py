"""Atomic training checkpoints: `<root>/step-00000123/` holding

  model/               the model in HF safetensors layout (engine.save_model) + the tokenizer
  optimizer.pt, scheduler.pt, rng.pt
  trainer_state.json   step, data position, anything the trainer needs to continue exactly
  manifest.json        written last: a directory without it is not a checkpoint

Everything is written into a hidden temp dir that is renamed into place, so a crash never leaves a
half checkpoint that `--resume auto` could pick. Only the last `keep_last` are kept.
"""
import json
import os
import random
import re
import shutil

import torch

STEP_DIR = re.compile(r"^step-(\d{8})$")
MANIFEST = "manifest.json"


def _default_save_model(model, path):
    """The engine's own models through engine.save_model (HF layout); a transformers model saves itself."""
    if hasattr(model, "save_pretrained"):
        return model.save_pretrained(path)
    from engine import save_model

    return save_model(model, path)


def rng_state() -> dict:
    state = {"python": random.getstate(), "torch": torch.get_rng_state()}
    try:
        import numpy as np
        state["numpy"] = np.random.get_state()
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np
        np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(root: str, step: int, model, optimizer=None, scheduler=None, trainer_state: dict | None = None,
                    tokenizer=None, keep_last: int = 2, save_model=None) -> str:
    """Writes checkpoint `step` under `root` atomically and prunes all but the last `keep_last`."""
    os.makedirs(root, exist_ok=True)
    final = os.path.join(root, f"step-{step:08d}")
    tmp = os.path.join(root, f".tmp-step-{step:08d}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    (save_model or _default_save_model)(model, os.path.join(tmp, "model"))
    if tokenizer is not None:
        tokenizer.save_pretrained(os.path.join(tmp, "model"))
    if optimizer is not None:
        torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
    if scheduler is not None:
        torch.save(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
    torch.save(rng_state(), os.path.join(tmp, "rng.pt"))
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump({"step": step, **(trainer_state or {})}, f, indent=1)
    files = sorted(os.path.relpath(os.path.join(d, n), tmp) for d, _, ns in os.walk(tmp) for n in ns)
    with open(os.path.join(tmp, MANIFEST), "w") as f:  # last: its presence means complete
        json.dump({"step": step, "files": {p: os.path.getsize(os.path.join(tmp, p)) for p in files}}, f, indent=1)
    if os.path.exists(final):  # a rerun of the same step replaces the old one
        shutil.rmtree(final)
    os.rename(tmp, final)
    for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def is_complete(path: str) -> bool:
    """A checkpoint is complete when its manifest is there and every file it lists has its size."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError):
        return False
    return all(os.path.isfile(os.path.join(path, p)) and os.path.getsize(os.path.join(path, p)) == n
               for p, n in manifest["files"].items())


def list_checkpoints(root: str) -> list:
    """Complete checkpoints under root, oldest first."""
    if not os.path.isdir(root):
        return []
    steps = sorted((int(m.group(1)), n) for n in os.listdir(root) if (m := STEP_DIR.match(n)))
    return [os.path.join(root, n) for _, n in steps if is_complete(os.path.join(root, n))]


def latest_checkpoint(root: str):
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve_resume(resume: str, root: str):
    """'none' -> None; 'auto' -> the latest complete checkpoint under root (or None); a path -> itself."""
    if resume == "none":
        return None
    if resume == "auto":
        return latest_checkpoint(root)
    if not is_complete(resume):
        raise ValueError(f"--resume {resume}: not a complete checkpoint (no valid {MANIFEST})")
    return resume


def load_checkpoint(path: str, optimizer=None, scheduler=None, restore_rng: bool = True) -> dict:
    """Restores optimizer, scheduler and RNG from `path` (the model loads from path/model) -> trainer state."""
    if optimizer is not None:
        optimizer.load_state_dict(torch.load(os.path.join(path, "optimizer.pt"), weights_only=False))
    if scheduler is not None:
        scheduler.load_state_dict(torch.load(os.path.join(path, "scheduler.pt"), weights_only=False))
    if restore_rng:
        set_rng_state(torch.load(os.path.join(path, "rng.pt"), weights_only=False))
    with open(os.path.join(path, "trainer_state.json")) as f:
        return json.load(f)
