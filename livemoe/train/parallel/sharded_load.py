"""A checkpoint read straight into a trainer rank's shards: the model is built on the meta device (no storage),
expert parallel and FSDP2 are applied there, the rank's shards get storage, and each is filled with only its rows
of the checkpoint's tensors (safetensors get_slice, the engine loader's reader), so no rank ever holds the whole
model (the decoder's tensor-parallel loader reads its slices the same way). Peak host memory per rank is its
shards, not the checkpoint: what makes Qwen3-30B-A3B (61 GB in bf16) loadable by 8 ranks of one host.

The rows a rank holds: FSDP2 shards dim 0 as torch.chunk does (ceil(n / S) rows per rank, the last ranks
short or empty); expert parallel first keeps EP rank r's experts [r * E/ep, (r + 1) * E/ep) of the stacked
expert tensors, and FSDP then shards those over the ranks holding the same experts.
"""
import math
import os

import torch
from torch.distributed.tensor import DTensor, Shard as DTensorShard

from livemoe.engine.model.config import load_config
from livemoe.engine.model.layers import RotaryEmbedding, SparseMoeBlock
from livemoe.engine.model.loader import WeightTargets, meta_model, read_checkpoint, resolve_dtype, weight_files
from livemoe.engine.model.tensor_parallel import Shard
from livemoe.train.parallel.mesh import ParallelMesh
from livemoe.train.parallel.parallelize import parallelize


def fsdp_rows(param) -> tuple[int, int]:
    """(first row, rows) of dim 0 of the (expert-parallel local) parameter this rank's FSDP shard holds."""
    if not isinstance(param, DTensor):
        return 0, param.shape[0]
    assert tuple(param.placements) == (DTensorShard(0),), param.placements  # FSDP2's default sharding
    n, size, rank = param.shape[0], param.device_mesh.size(), param.device_mesh.get_local_rank()
    per = math.ceil(n / size)
    first = min(rank * per, n)
    rows = param.to_local().shape[0]
    assert rows == min(per, n - first), (n, size, rank, rows)
    return first, rows


def load_sharded(path: str, mesh: ParallelMesh, *, dtype=torch.float32, param_dtype=torch.bfloat16,
                 reduce_dtype=torch.float32):
    """parallelize(load_model(path, dtype)) without the whole model in memory: the same parameters, each rank
    holding and reading only its shards (CheckpointError as load_model raises them)."""
    cfg = load_config(path)
    dtype = resolve_dtype(dtype, cfg)
    files = weight_files(path)
    full = {n: tuple(p.shape) for n, p in meta_model(cfg).named_parameters()}
    model = meta_model(cfg).to(dtype)
    parallelize(model, mesh, param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    model.to_empty(device=mesh.device)
    model.model.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta).to(mesh.device)  # buffers were meta
    first_expert = {}  # stacked expert tensors: the first expert this EP rank keeps
    for prefix, block in model.named_modules():
        if isinstance(block, SparseMoeBlock) and block.experts.expert_parallel is not None:
            for name in ("gate_up_proj", "down_proj"):
                first_expert[f"{prefix}.experts.{name}"] = block.experts.expert_parallel.local_experts.start
    params, shards = {}, {}
    for name, p in model.named_parameters():
        first, rows = fsdp_rows(p)
        first += first_expert.get(name, 0)
        params[name] = p.to_local() if isinstance(p, DTensor) else p
        shards[name] = Shard(0, ((first, first + rows),))
    with torch.no_grad():
        read_checkpoint(path, files, WeightTargets(model, full, params, shards), cfg.model_type, dtype)
    model.source_dir = os.path.abspath(path)
    return model.eval()
