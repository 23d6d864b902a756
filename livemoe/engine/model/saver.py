"""Saving a model as a Hugging Face checkpoint (config.json + safetensors, sharded with an index past
max_shard_size), in the hub's per-expert layout or transformers-v5's fused one. A checkpoint is written to a
temporary directory beside the target and moved into place whole, so a reader never sees half of one.
"""
import json
import os
import shutil
import tempfile

import torch
from safetensors.torch import save_file

from livemoe.engine.errors import CheckpointError
from livemoe.engine.model.loader import INDEX_FILE, SINGLE_FILE, TOKENIZER_FILES, first_nonfinite
from livemoe.engine.model.qwen3 import Qwen3ForCausalLM


def _check_whole(model: Qwen3ForCausalLM) -> None:
    if getattr(model, "tensor_parallel", None) is not None:
        raise ValueError(f"this model is one rank's shard ({model.tensor_parallel.to_dict()}), not the whole "
                         "model: its tensors are not the checkpoint's; save the model from one process")


def hub_state_dict(model: Qwen3ForCausalLM, layout: str = "per_expert") -> dict[str, torch.Tensor]:
    """The model's tensors under hub keys; per_expert splits the stacked experts (views, no copies)."""
    _check_whole(model)
    if layout not in ("per_expert", "fused"):
        raise ValueError(f"layout must be 'per_expert' or 'fused', got {layout!r}")
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        if layout == "per_expert" and name.endswith("experts.gate_up_proj"):
            prefix, half = name.removesuffix(".gate_up_proj"), t.shape[1] // 2
            for j in range(t.shape[0]):
                out[f"{prefix}.{j}.gate_proj.weight"] = t[j, :half]
                out[f"{prefix}.{j}.up_proj.weight"] = t[j, half:]
        elif layout == "per_expert" and name.endswith("experts.down_proj"):
            prefix = name.removesuffix(".down_proj")
            for j in range(t.shape[0]):
                out[f"{prefix}.{j}.down_proj.weight"] = t[j]
        else:
            out[name] = t
    return out


def _shards(state: dict, max_shard_bytes: int) -> list[dict]:
    shards, current, size = [], {}, 0
    for key, t in state.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[key] = t
        size += nbytes
    if current or not shards:
        shards.append(current)
    return shards


def save_model(model: Qwen3ForCausalLM, path: str, *, max_shard_size: int = 5 * 2**30, layout: str = "per_expert",
               tokenizer=None) -> str:
    """Writes config.json + safetensors (sharded above max_shard_size bytes, with an index) + the tokenizer
    files (of `tokenizer`, else copied from the checkpoint the model was loaded from). transformers'
    AutoModelForCausalLM.from_pretrained loads the result. The directory appears whole or not at all,
    with the umask's usual permissions. Weights holding NaN or Inf are refused (CheckpointError)."""
    path = os.path.abspath(path)
    _check_whole(model)
    bad = first_nonfinite(model.named_parameters())
    if bad is not None:
        raise CheckpointError(f"not saving {path}: parameter {bad!r} holds NaN or Inf values")
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(path)}.tmp-", dir=parent)
    try:
        state = hub_state_dict(model, layout)
        shards = _shards(state, max_shard_size)
        dtype = next(iter(state.values())).dtype
        if len(shards) == 1:
            save_file({k: v.contiguous().cpu() for k, v in shards[0].items()}, os.path.join(tmp, SINGLE_FILE),
                      metadata={"format": "pt"})
        else:
            weight_map = {}
            for i, shard in enumerate(shards):
                name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                save_file({k: v.contiguous().cpu() for k, v in shard.items()}, os.path.join(tmp, name),
                          metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(shard, name))
            total = sum(t.numel() * t.element_size() for t in state.values())
            with open(os.path.join(tmp, INDEX_FILE), "w") as f:
                json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
        config = model.config.to_dict()
        config["dtype"] = str(dtype).removeprefix("torch.")
        config.setdefault("architectures", ["Qwen3MoeForCausalLM" if model.config.num_experts else "Qwen3ForCausalLM"])
        with open(os.path.join(tmp, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        else:
            source = getattr(model, "source_dir", None)
            for name in TOKENIZER_FILES:
                if source and os.path.exists(os.path.join(source, name)):
                    shutil.copy(os.path.join(source, name), os.path.join(tmp, name))
        apply_umask(tmp)
        _replace_dir(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


def apply_umask(root: str) -> None:
    """Gives root and everything under it the modes a plain mkdir/open would (0755/0644 under umask 0022):
    mkdtemp makes its dir 0700 and safetensors writes its files 0600, so a folder that was built in a
    temp dir and renamed into place could otherwise be read by its owner alone."""
    umask = _umask()
    os.chmod(root, 0o777 & ~umask)
    for d, dirs, files in os.walk(root):
        for n, mode in [(n, 0o777) for n in dirs] + [(n, 0o666) for n in files]:
            if not os.path.islink(os.path.join(d, n)):
                os.chmod(os.path.join(d, n), mode & ~umask)


def _umask() -> int:
    """The process umask, read without changing it where Linux allows (os.umask can only set it, and
    setting it briefly would race with threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _replace_dir(src: str, dst: str) -> None:
    """Moves the finished directory into place; an existing one is set aside first, then removed."""
    old = None
    if os.path.exists(dst):
        old = tempfile.mkdtemp(prefix=f".{os.path.basename(dst)}.old-", dir=os.path.dirname(dst))
        os.rmdir(old)
        os.rename(dst, old)
    os.rename(src, dst)
    if old:
        shutil.rmtree(old, ignore_errors=True)
