"""Weight updates into a loaded model: in-place copies of (name, tensor) pairs, by the loader's name
mapping (hub names, per-expert or fused experts, engine names). Every name and shape is checked, and
the new values must be finite, before the first copy: a refused update leaves the old weights whole.

An update is staged, then applied: `stage_weights` / `stage_weights_from_disk` check everything and hold
what each parameter will receive; `Staged.apply` copies. A tensor-parallel rank's model (its layers name
the slices they hold, livemoe.engine.model.tensor_parallel) stages only its slices of each full tensor, and
reads only those from a checkpoint (safetensors get_slice), as the loader does; the ranks of a
tensor-parallel engine stage, agree, then apply (livemoe.engine.decoder.workers).

Used by LLM.update_weights (a trainer's tensors), LLM.update_weights_from_disk (a checkpoint of the same
architecture) and the distributed path (livemoe.engine.core.weight_sync receives the tensors first).
"""
import os
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from livemoe.engine.errors import CheckpointError
from livemoe.engine.model.loader import WeightTargets, first_nonfinite, load_config, meta_model, weight_files

# [(destination view, index into the key's tensor or None for all of it)]: what one key fills on this rank
Copies = list[tuple[torch.Tensor, tuple | None]]


@dataclass
class Staged:
    """A checked update: (destination view, new value) pairs, applied together."""
    pairs: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    num_tensors: int = 0  # the keys it holds (what an update reports)

    @torch.no_grad()
    def apply(self) -> int:
        for dest, value in self.pairs:
            dest.copy_(value)
        return self.num_tensors


def weight_targets(model) -> WeightTargets:
    """The targets of a model, or of a tensor-parallel rank's shard (whose keys still carry full shapes)."""
    if getattr(model, "tensor_parallel", None) is None:
        return WeightTargets(model)
    full = meta_model(model.config)
    return WeightTargets(model, {n: tuple(p.shape) for n, p in full.named_parameters()})


def _plan(model, shapes: dict[str, tuple], where: str) -> tuple[dict[str, Copies], list[str]]:
    """-> ({key: what it fills on this rank}, parameter names no key filled); CheckpointError naming the key
    for a name the model has not, a shape that differs or a part given twice."""
    targets = weight_targets(model)
    plan = {}
    for key, shape in shapes.items():
        target = targets.locate(key)
        if target is None:
            continue
        name, region, part = target
        if name not in targets.params or region is None:
            raise CheckpointError(f"{where}: unexpected tensor {key!r} (no such parameter in this model)")
        expected = tuple(n for _, n, kept in region if kept)
        if tuple(shape) != expected:
            raise CheckpointError(f"{where}: tensor {key!r} has shape {tuple(shape)}, but the loaded model's is "
                                  f"{expected} (a checkpoint of another architecture?)")
        copies = targets.copies(name, region)
        if not copies:
            continue  # another expert-parallel rank's experts
        filled = targets.filled[name]
        if part in filled or "whole" in filled or (part == "whole" and filled):
            raise CheckpointError(f"{where}: tensor {key!r} given twice")
        filled.add(part)
        plan[key] = [(targets.params[name].data[index], src) for index, src in copies]
    return plan, targets.missing()


def _take(tensor, src: tuple | None, own: bool) -> torch.Tensor:
    """The part of `tensor` (a tensor or a safetensors slice) a copy reads; `own`: a copy of its own, so the
    (larger) source can be freed."""
    if src is None:
        return tensor if isinstance(tensor, torch.Tensor) else tensor[:]
    part = tensor[src]
    return part.clone() if own and isinstance(tensor, torch.Tensor) else part


@torch.no_grad()
def stage_weights(model, named_tensors, where: str = "update_weights", shapes: dict | None = None) -> Staged:
    """Checks (name, tensor) pairs (a subset is fine) against model. shapes ({name: shape}, known before the
    tensors arrive, as in a broadcast): the names and shapes are checked first, then the tensors are taken as
    they come and each keeps a copy of only this rank's slices (the received buffers can go). The pairs are
    consumed whole even when the check fails (every broadcast is received)."""
    if shapes is None:
        named_tensors = dict(named_tensors)
        shapes = {k: tuple(t.shape) for k, t in named_tensors.items()}
        items, own = named_tensors.items(), False
    else:
        items, own = named_tensors, True
    try:
        plan, _ = _plan(model, shapes, where)
    except CheckpointError:
        for _ in items:
            pass
        raise
    taken = [(key, dest, _take(t, src, own)) for key, t in items if key in plan for dest, src in plan[key]]
    bad = first_nonfinite((key, value) for key, _, value in taken)
    if bad is not None:
        raise CheckpointError(f"{where}: tensor {bad!r} holds NaN or Inf values")
    return Staged([(dest, value) for _, dest, value in taken], len(plan))


def copy_weights(model, named_tensors, where: str = "update_weights") -> int:
    """Copies (name, tensor) pairs into model's parameters (a subset is fine); returns how many."""
    return stage_weights(model, named_tensors, where).apply()


def checkpoint_shapes(model, path: str) -> tuple[dict[str, tuple], dict[str, str]]:
    """({key: shape}, {key: file}) from the safetensors headers of a checkpoint directory of model's type."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory (a weight update reads a checkpoint directory holding "
                              "config.json and safetensors files)")
    cfg = load_config(path)
    same_thinker = cfg.omni is not None and model.config.omni is not None  # a whole Omni checkpoint or its thinker
    if cfg.model_type != model.config.model_type and not same_thinker:
        raise CheckpointError(f"{path}: model_type {cfg.model_type!r}, but the loaded model is "
                              f"{model.config.model_type!r}")
    shapes, where = {}, {}
    for file in weight_files(path):
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    shapes[key], where[key] = tuple(f.get_slice(key).get_shape()), file
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 (safetensors' own error types)
            raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None
    return shapes, where


@torch.no_grad()
def stage_weights_from_disk(model, path: str) -> Staged:
    """A whole checkpoint of the same architecture (every parameter must be in it): names and shapes from the
    headers are checked before any tensor is read, then this rank's slices are read and checked finite.
    `path` must be a checkpoint directory: anything else (a device file such as /dev/zero would be read without
    end) is refused unread."""
    shapes, where = checkpoint_shapes(model, path)
    plan, missing = _plan(model, shapes, path)
    if missing:
        raise CheckpointError(f"{path}: missing tensors: {', '.join(missing[:8])}")
    staged = Staged(num_tensors=len(plan))
    for file in sorted(set(where[k] for k in plan)):
        with safe_open(file, framework="pt", device="cpu") as f:
            read = [(key, dest, _take(f.get_slice(key), src, False))
                    for key in plan if where[key] == file for dest, src in plan[key]]
        bad = first_nonfinite((key, value) for key, _, value in read)
        if bad is not None:
            raise CheckpointError(f"{file}: tensor {bad!r} holds NaN or Inf values")
        staged.pairs += [(dest, value) for _, dest, value in read]
    return staged


def copy_weights_from_disk(model, path: str) -> int:
    """Copies a whole checkpoint of the same architecture into model; returns how many tensors."""
    return stage_weights_from_disk(model, path).apply()
