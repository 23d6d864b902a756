"""Atomic, verified training checkpoints: `<root>/step-00000123/` holding

  model/               the model in HF safetensors layout (engine.save_model) + the tokenizer
  optimizer.pt, scheduler.pt, rng.pt   tensors and plain values only: they load with weights_only=True
  trainer_state.json   step, data position, anything the trainer needs to continue exactly
  manifest.json        written last: every file's size and sha256; a directory without it is not a checkpoint

Everything is written into a hidden temp dir that is renamed into place, so a crash never leaves a
half checkpoint that `--resume auto` could pick; temp dirs left by killed saves are removed (with a log
line). Weights or optimizer state holding NaN or Inf are never saved, so keep-last (only the last
`keep_last` are kept) never rotates a good checkpoint away for a broken one. Resuming verifies every
file against the manifest and falls back, with a line saying which and why, to the newest valid one.

Under torchrun (save_sharded_checkpoint) `model/` and `optimizer.pt` are replaced by

  dcp/                 torch.distributed.checkpoint of {"model", "optimizer"}: every rank writes its shards, in
                       parallel; any number of ranks (one process too) loads it back, resharded
  scheduler.pt, rng.pt, trainer_state.json   rank 0's (every rank holds the same schedule; rank 0's RNG is
                       restored on every rank)

with the same atomicity: rank 0 makes the temp dir, every rank writes its shards into it, a barrier, the ranks
checksum the files in parallel, rank 0 writes the manifest and renames. A rank killed at any point leaves a
temp dir without a manifest, which the next run removes; the previous checkpoint stays the newest valid one.
The output dir must be on a filesystem every rank sees (as torch.distributed.checkpoint's writer needs).

sha256 over xxhash or crc32: it is the standard (the hub's LFS ids use it) and, with the SHA
instructions of current CPUs, measured 1.7 GiB/s here, close to crc32's 4 GiB/s and well above the
rate a checkpoint is written; blake2b was slower (0.9 GiB/s).
"""
import errno
import hashlib
import json
import os
import random
import re
import shutil
import warnings

import torch

from livemoe.engine.errors import CheckpointError
from livemoe.engine.model.loader import first_nonfinite
from livemoe.engine.model.saver import apply_umask

STEP_DIR = re.compile(r"^step-(\d{8})$")
TMP_DIR = re.compile(r"^\.tmp-step-\d{8}-(\d+)$")
MANIFEST = "manifest.json"


def log(msg: str) -> None:
    print(f"[checkpoint] {msg}", flush=True)


def _default_save_model(model, path):
    """The engine's own models through engine.save_model (HF layout); a transformers model saves itself."""
    if hasattr(model, "save_pretrained"):
        return model.save_pretrained(path)
    from livemoe.engine import save_model

    return save_model(model, path)


def rng_state() -> dict:
    """Every RNG's state as tensors and plain values (loadable with weights_only=True)."""
    version, internal, gauss = random.getstate()
    state = {"python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64), "gauss": gauss},
             "torch": torch.get_rng_state()}
    try:
        import numpy as np
        key, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = {"key": key, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                          "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np
        n = state["numpy"]
        np.random.set_state((n["key"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached_gaussian"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(8 << 20):
            h.update(chunk)
    return h.hexdigest()


def _optimizer_tensors(optimizer):
    for i, (_, st) in enumerate(optimizer.state_dict()["state"].items() if optimizer is not None else []):
        for k, v in st.items():
            if isinstance(v, torch.Tensor):
                yield f"optimizer state {k} of parameter {i}", v


def remove_orphans(root: str) -> None:
    """Removes `.tmp-step-*` dirs under root that a killed save left (its process is gone)."""
    if not os.path.isdir(root):
        return
    for name in sorted(os.listdir(root)):
        m = TMP_DIR.match(name)
        if m and (int(m.group(1)) == os.getpid() or not _alive(int(m.group(1)))):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
            log(f"removed {os.path.join(root, name)}: left by a save that was interrupted (process {m.group(1)})")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def _refuse_nonfinite(bad, step: int, root: str) -> None:
    if bad is not None:
        raise CheckpointError(f"not saving checkpoint step {step}: {bad!r} holds NaN or Inf values; the earlier "
                              f"checkpoints under {root} are kept")


def begin_save(root: str, step: int) -> tuple:
    """(final dir, temp dir): removes what killed saves left under root and makes the temp dir, named after
    this process (so a later run sees whether its writer is gone)."""
    os.makedirs(root, exist_ok=True)
    remove_orphans(root)
    final = os.path.join(root, f"step-{step:08d}")
    tmp = os.path.join(root, f".tmp-step-{step:08d}-{os.getpid()}")
    os.makedirs(tmp)
    return final, tmp


def write_state_files(tmp: str, step: int, scheduler=None, trainer_state: dict | None = None) -> None:
    """scheduler.pt, rng.pt and trainer_state.json: what a checkpoint holds besides the model and optimizer."""
    if scheduler is not None:
        torch.save(scheduler.state_dict(), os.path.join(tmp, "scheduler.pt"))
    torch.save(rng_state(), os.path.join(tmp, "rng.pt"))
    with open(os.path.join(tmp, "trainer_state.json"), "w") as f:
        json.dump({"step": step, **(trainer_state or {})}, f, indent=1)


def list_files(tmp: str) -> list:
    """Every file under tmp, relative to it, sorted (what the manifest lists)."""
    return sorted(os.path.relpath(os.path.join(d, n), tmp) for d, _, ns in os.walk(tmp) for n in ns)


def file_digests(tmp: str, names: list) -> dict:
    """{name: {size, sha256}} of files under tmp (the manifest's entries)."""
    return {p: {"size": os.path.getsize(os.path.join(tmp, p)), "sha256": sha256(os.path.join(tmp, p))} for p in names}


def finish_save(root: str, step: int, tmp: str, final: str, digests: dict, keep_last: int) -> str:
    """Writes the manifest (last: its presence means complete), renames tmp into place and prunes all but the
    last keep_last checkpoints."""
    with open(os.path.join(tmp, MANIFEST), "w") as f:
        json.dump({"step": step, "files": dict(sorted(digests.items()))}, f, indent=1)
    apply_umask(tmp)  # readable by others as any folder the user makes (save_model's files come 0600)
    if os.path.exists(final):  # a rerun of the same step replaces the old one
        shutil.rmtree(final)
    os.rename(tmp, final)
    for old in list_checkpoints(root)[:-keep_last] if keep_last > 0 else []:
        shutil.rmtree(old, ignore_errors=True)
    return final


def save_checkpoint(root: str, step: int, model, optimizer=None, scheduler=None, trainer_state: dict | None = None,
                    tokenizer=None, keep_last: int = 2, save_model=None) -> str:
    """Writes checkpoint `step` under `root` atomically and prunes all but the last `keep_last`.
    Raises CheckpointError, writing and removing nothing, when the weights or optimizer state hold NaN/Inf."""
    _refuse_nonfinite(first_nonfinite(list(model.named_parameters()) + list(_optimizer_tensors(optimizer))), step, root)
    final, tmp = begin_save(root, step)
    try:
        (save_model or _default_save_model)(model, os.path.join(tmp, "model"))
        if tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(tmp, "model"))
        if optimizer is not None:
            torch.save(optimizer.state_dict(), os.path.join(tmp, "optimizer.pt"))
        write_state_files(tmp, step, scheduler, trainer_state)
        return finish_save(root, step, tmp, final, file_digests(tmp, list_files(tmp)), keep_last)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)  # (the earlier checkpoints were not touched)
        if is_disk_full(e):
            raise CheckpointError(disk_full_message(root, step)) from None
        raise


DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
# how torch.save (its zip writer), safetensors and others word an ENOSPC they wrap in their own exception
DISK_FULL_TEXTS = ("No space left on device", "file write failed", "StorageFull", "os error 28", "Disk quota exceeded")


def is_disk_full(e: BaseException) -> bool:
    """Whether a write failed for want of space: OSError(ENOSPC / EDQUOT), or a library's error wrapping one."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in DISK_FULL_ERRNOS:
            return True
        if isinstance(e, (RuntimeError, OSError, ValueError)) and any(t in str(e) for t in DISK_FULL_TEXTS):
            return True
        e = e.__cause__ or e.__context__
    return False


def disk_full_message(root: str, step: int) -> str:
    try:
        free = f"{shutil.disk_usage(root).free / 2**20:.1f} MiB free"
    except OSError:
        free = "free space unknown"
    return (f"not saving checkpoint step {step}: no space left on device under {os.path.abspath(root)} ({free}); "
            "the earlier checkpoints there are kept and the partial one was removed")


def check_checkpoint(path: str, checksums: bool = True) -> str | None:
    """Why `path` is not a valid checkpoint (None when it is): its manifest must be there and every file
    it lists must have its size and (with checksums) its sha256. Manifests of older versions hold sizes only."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)["files"]
        assert isinstance(files, dict)
    except FileNotFoundError:
        return f"no {MANIFEST} (an interrupted save?)"
    except (OSError, ValueError, KeyError, TypeError, AssertionError) as e:
        return f"{MANIFEST} is unreadable ({type(e).__name__}: {e})"
    for name, want in files.items():
        if not isinstance(want, (int, dict)):
            return f"{MANIFEST}: the entry of {name!r} is neither a size nor {{size, sha256}}"
        size, digest = (want, None) if isinstance(want, int) else (want.get("size"), want.get("sha256"))
        file = os.path.join(path, name)
        if os.path.isabs(name) or os.path.normpath(name).split(os.sep)[0] == "..":
            return f"{MANIFEST} lists {name!r}, outside the checkpoint"
        if not os.path.isfile(file):
            return f"{name} is missing"
        if os.path.getsize(file) != size:
            return f"{name} has {os.path.getsize(file)} bytes, the manifest says {size} (truncated?)"
        if checksums and digest is not None and sha256(file) != digest:
            return f"{name} does not match its sha256 in the manifest (the file was changed or corrupted)"
    return None


def is_complete(path: str) -> bool:
    """Cheap: the manifest is there and every file it lists has its size (no checksums)."""
    return check_checkpoint(path, checksums=False) is None


def _step_dirs(root: str) -> list:
    if not os.path.isdir(root):
        return []
    steps = sorted((int(m.group(1)), n) for n in os.listdir(root) if (m := STEP_DIR.match(n)))
    return [os.path.join(root, n) for _, n in steps]


def list_checkpoints(root: str) -> list:
    """Complete checkpoints under root (by size, no checksums), oldest first."""
    return [p for p in _step_dirs(root) if is_complete(p)]


def latest_checkpoint(root: str):
    """The newest checkpoint under root whose files all match the manifest's checksums (None if none);
    each newer one that does not is skipped with a log line saying why."""
    for path in reversed(_step_dirs(root)):
        why = check_checkpoint(path)
        if why is None:
            return path
        log(f"skipping checkpoint {path}: {why}")
    return None


def resolve_resume(resume: str, root: str):
    """'none' -> None; 'auto' -> the newest valid checkpoint under root (or None); a path -> itself, verified.
    Removes temp dirs that killed saves left under root."""
    if resume == "none":
        return None
    remove_orphans(root)
    if resume == "auto":
        return latest_checkpoint(root)
    why = check_checkpoint(resume)
    if why is not None:
        raise CheckpointError(f"--resume {resume}: not a valid checkpoint: {why}")
    return resume


def _load_pt(path: str, name: str):
    file = os.path.join(path, name)
    try:
        return torch.load(file, map_location="cpu", weights_only=True)  # never unpickles code
    except Exception as e:  # torch raises pickle, zip and runtime errors for a damaged file
        first_line = (str(e).splitlines() or [""])[0]  # torch's weights_only message runs to a page
        raise CheckpointError(f"{file}: cannot be loaded ({type(e).__name__}: {first_line})") from None


def load_checkpoint(path: str, optimizer=None, scheduler=None, restore_rng: bool = True, model=None,
                    comm=None) -> dict:
    """Restores optimizer, scheduler and RNG from `path` (the model loads from path/model) -> trainer state.
    A sharded checkpoint (save_sharded_checkpoint) also restores `model`'s weights, into any sharding: one
    process, or the ranks of `comm`. Any unreadable or mismatched file is a CheckpointError naming it."""
    sharded = is_sharded(path)
    if sharded:
        _load_sharded(path, model, optimizer, comm)
    elif comm is not None and comm.world_size > 1 and optimizer is not None:
        raise CheckpointError(f"{path}: written by one process (optimizer.pt); under torchrun resume from a "
                              "checkpoint written under torchrun, or start a new run from its model/ (--model)")
    for obj, name in ((None if sharded else optimizer, "optimizer.pt"), (scheduler, "scheduler.pt")):
        if obj is not None:
            state = _load_pt(path, name)
            try:
                obj.load_state_dict(state)
            except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
                raise CheckpointError(f"{os.path.join(path, name)}: does not fit this run ({e})") from None
    if restore_rng:
        state = _load_pt(path, "rng.pt")
        try:
            set_rng_state(state)
        except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as e:
            raise CheckpointError(f"{os.path.join(path, 'rng.pt')}: not an RNG state of this version "
                                  f"({type(e).__name__}: {e})") from None
    try:
        with open(os.path.join(path, "trainer_state.json")) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{os.path.join(path, 'trainer_state.json')}: unreadable ({e})") from None


# ------------------------------------------------------------------------------------------ sharded (torchrun)
DCP_DIR = "dcp"


def is_sharded(path: str) -> bool:
    """Whether the checkpoint at path was written by save_sharded_checkpoint (torch.distributed.checkpoint)."""
    return os.path.isdir(os.path.join(path, DCP_DIR))


def model_dir(path: str | None):
    """The HF-layout model of checkpoint `path` (a one-process save), None for a sharded one (its weights load
    into the model after it is built: load_checkpoint(..., model=model)) or no checkpoint."""
    return os.path.join(path, "model") if path and not is_sharded(path) else None


def _dcp_state(model, optimizer, comm):
    """(state, restore): model and optimizer state dicts keyed by parameter name (so any sharding maps onto
    any other), in comm's checkpoint view (expert-parallel shards as slices of the whole experts tensor);
    restore() puts the trainer's own views back after an in-place load."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    state = {"model": get_model_state_dict(model)}
    if optimizer is not None:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer)
    return state, (comm.checkpoint_view(state) if comm is not None else (lambda: None))


def save_sharded_checkpoint(root: str, step: int, model, optimizer, scheduler, trainer_state: dict | None,
                            comm, keep_last: int = 2) -> str:
    """save_checkpoint for a model sharded over the ranks of `comm` (livemoe.train.distributed.Distributed): every rank
    calls it. CheckpointError on every rank, writing nothing, when any rank's shards hold NaN or Inf."""
    import torch.distributed.checkpoint as dcp

    state, _ = _dcp_state(model, optimizer, None)
    local = [(name, t.to_local() if hasattr(t, "to_local") else t) for name, t in _named_leaves(state)]
    bad = [b for b in comm.all_gather_objects(first_nonfinite(local)) if b is not None]
    _refuse_nonfinite(bad[0] if bad else None, step, root)
    final, tmp = comm.from_main(lambda: begin_save(root, step))
    restore = comm.checkpoint_view(state)
    try:
        dcp.save(state, checkpoint_id=os.path.join(tmp, DCP_DIR))
        if comm.is_main:
            write_state_files(tmp, step, scheduler, {**(trainer_state or {}), "world_size": comm.world_size})
    except Exception as e:  # (the temp dir is removed by the next run: other ranks may still be writing into it)
        if is_disk_full(e):
            raise CheckpointError(disk_full_message(root, step)) from None
        raise
    finally:
        restore()
    comm.barrier()  # every shard and state file is written
    names = comm.from_main(lambda: list_files(tmp))
    digests = {}
    for part in comm.all_gather_objects(file_digests(tmp, names[comm.rank::comm.world_size])):
        digests.update(part)
    comm.from_main(lambda: finish_save(root, step, tmp, final, digests, keep_last))
    return final


def _named_leaves(tree, prefix=""):
    if isinstance(tree, dict):
        for k, v in tree.items():
            yield from _named_leaves(v, f"{prefix}{k}.")
    elif isinstance(tree, torch.Tensor):
        yield prefix[:-1], tree


def _load_sharded(path: str, model, optimizer, comm) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    if model is None:
        raise CheckpointError(f"{path}: a sharded checkpoint; its weights load into the built model "
                              "(load_checkpoint(..., model=model))")
    state, restore = _dcp_state(model, optimizer, comm)
    try:
        with warnings.catch_warnings():  # one process loading a sharded checkpoint is intended here
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(state, checkpoint_id=os.path.join(path, DCP_DIR), no_dist=not torch.distributed.is_initialized())
    except (Exception, CheckpointException) as e:  # noqa: BLE001  (DCP's exception is a BaseException)
        why = (str(e).strip().splitlines() or [""])[-1]  # DCP wraps each rank's traceback: its last line says why
        raise CheckpointError(f"{os.path.join(path, DCP_DIR)}: does not fit this model and optimizer (a checkpoint "
                              f"of another model?): {why}") from None
    finally:
        restore()
    set_model_state_dict(model, state["model"])
    if optimizer is not None:
        set_optimizer_state_dict(model, optimizer, state["optimizer"])
