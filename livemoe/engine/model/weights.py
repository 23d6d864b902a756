"""Weight updates into a loaded model: in-place copies of (name, tensor) pairs, by the loader's name
mapping (hub names, per-expert or fused experts, engine names). Every name and shape is checked, and
the new values must be finite, before the first copy: a refused update leaves the old weights whole.

Used by LLM.update_weights (a trainer's tensors), LLM.update_weights_from_disk (a checkpoint of the same
architecture) and the distributed path (livemoe.engine.core.weight_sync receives the tensors first).
"""
import os

import torch
from safetensors import safe_open

from livemoe.engine.errors import CheckpointError
from livemoe.engine.model.loader import WeightTargets, weight_files, first_nonfinite, load_config


def _plan(model, shapes: dict[str, tuple], where: str) -> tuple[list[tuple[str, torch.Tensor]], list[str]]:
    """-> ([(key, destination view)], parameter names no key filled); CheckpointError naming the key
    for a name the model has not, a shape that differs or a part given twice."""
    targets = WeightTargets(model)
    plan = []
    for key, shape in shapes.items():
        target = targets.resolve(key)
        if target is None:
            continue
        name, index, part = target
        if name not in targets.params:
            raise CheckpointError(f"{where}: unexpected tensor {key!r} (no such parameter in this model)")
        filled = targets.filled[name]
        if part in filled or "whole" in filled or (part == "whole" and filled):
            raise CheckpointError(f"{where}: tensor {key!r} given twice")
        dest = targets.params[name].data[index] if index else targets.params[name].data
        if tuple(shape) != tuple(dest.shape):
            raise CheckpointError(f"{where}: tensor {key!r} has shape {tuple(shape)}, but the loaded model's is "
                                  f"{tuple(dest.shape)} (a checkpoint of another architecture?)")
        targets.filled[name].add(part)
        plan.append((key, dest))
    return plan, targets.missing()


@torch.no_grad()
def copy_weights(model, named_tensors, where: str = "update_weights") -> int:
    """Copies (name, tensor) pairs into model's parameters (a subset is fine); returns how many."""
    tensors = dict(named_tensors)
    bad = first_nonfinite(tensors.items())
    if bad is not None:
        raise CheckpointError(f"{where}: tensor {bad!r} holds NaN or Inf values")
    plan, _ = _plan(model, {k: tuple(t.shape) for k, t in tensors.items()}, where)
    for key, dest in plan:
        dest.copy_(tensors[key])
    return len(plan)


@torch.no_grad()
def copy_weights_from_disk(model, path: str) -> int:
    """Copies a whole checkpoint of the same architecture (every parameter must be in it) into model:
    names and shapes from the safetensors headers are checked before any tensor is read. `path` must be a checkpoint
    directory: anything else (a device file such as /dev/zero would be read without end) is refused unread."""
    if not os.path.isdir(path):
        raise CheckpointError(f"{path}: not a directory (a weight update reads a checkpoint directory holding "
                              "config.json and safetensors files)")
    cfg = load_config(path)
    same_thinker = cfg.omni is not None and model.config.omni is not None  # a whole Omni checkpoint or its thinker
    if cfg.model_type != model.config.model_type and not same_thinker:
        raise CheckpointError(f"{path}: model_type {cfg.model_type!r}, but the loaded model is "
                              f"{model.config.model_type!r}")
    files = weight_files(path)
    shapes, where = {}, {}
    for file in files:
        try:
            with safe_open(file, framework="pt", device="cpu") as f:
                for key in f.keys():
                    shapes[key], where[key] = tuple(f.get_slice(key).get_shape()), file
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001 (safetensors' own error types)
            raise CheckpointError(f"{file}: unreadable safetensors file ({e})") from None
    plan, missing = _plan(model, shapes, path)
    if missing:
        raise CheckpointError(f"{path}: missing tensors: {', '.join(missing[:8])}")
    for file in files:  # every tensor is read (and checked finite) before the first copy
        with safe_open(file, framework="pt", device="cpu") as f:
            tensors = {key: f.get_tensor(key) for key, _ in plan if where[key] == file}
        bad = first_nonfinite(tensors.items())
        if bad is not None:
            raise CheckpointError(f"{file}: tensor {bad!r} holds NaN or Inf values")
        where.update({key: tensors[key] for key in tensors})
    for key, dest in plan:
        dest.copy_(where[key])
    return len(plan)
