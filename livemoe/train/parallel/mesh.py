"""The device mesh of a torchrun job: which ranks shard what, set up once from torchrun's environment.

Layout (torchtitan's, for MoE): every rank is data-parallel for the dense weights (the `dp` mesh, all
ranks; FSDP shards them over it). Expert parallel borrows `expert_parallel` consecutive ranks (an EP
group, one node's fast links): each holds num_experts / expert_parallel whole experts of every MoE layer.
The ranks with the same EP index in the other groups hold the same experts and shard them among
themselves (the `dp_mod_ep` mesh, world_size / expert_parallel ranks).

Every collective has a timeout (`timeout_s`): a rank that dies or stops makes the others raise, never hang.
One process without torchrun (no WORLD_SIZE) gets world size 1 and no process group: today's path.
"""
import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


@dataclass(frozen=True, kw_only=True)
class ParallelDims:
    """The sizes of the mesh, validated in one place (ValueError naming the values)."""
    world_size: int
    expert_parallel: int = 1

    def __post_init__(self):
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.expert_parallel < 1:
            raise ValueError(f"expert_parallel must be >= 1, got {self.expert_parallel}")
        if self.world_size % self.expert_parallel:
            raise ValueError(f"expert_parallel={self.expert_parallel} does not divide world_size={self.world_size}: "
                             f"each EP group needs expert_parallel whole ranks")

    @property
    def dp_mod_ep(self) -> int:
        """Ranks that hold the same experts (they shard them with FSDP)."""
        return self.world_size // self.expert_parallel

    def check_experts(self, num_experts: int) -> None:
        """ValueError unless every EP rank can hold the same number of whole experts."""
        if self.expert_parallel > 1 and (num_experts <= 0 or num_experts % self.expert_parallel):
            raise ValueError(f"expert_parallel={self.expert_parallel} does not divide the model's num_experts="
                             f"{num_experts}: each EP rank must hold num_experts / expert_parallel whole experts")

    def to_dict(self) -> dict:
        return {"world_size": self.world_size, "expert_parallel": self.expert_parallel,
                "data_parallel": self.world_size, "expert_data_parallel": self.dp_mod_ep}


@dataclass(frozen=True, kw_only=True)
class ParallelMesh:
    """This rank's place in the job. Meshes are None in a single process (nothing to shard)."""
    dims: ParallelDims
    rank: int
    local_rank: int
    device: torch.device
    dp: DeviceMesh | None = None
    ep: DeviceMesh | None = None
    dp_mod_ep: DeviceMesh | None = None

    @property
    def is_main(self) -> bool:
        """Rank 0 alone prints and writes."""
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.dims.world_size > 1


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None:
        return default
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer (torchrun sets it)") from None


def build_mesh(dims: ParallelDims, device_type: str) -> tuple[DeviceMesh, DeviceMesh, DeviceMesh]:
    """(dp, ep, dp_mod_ep) over an initialised process group; EP groups are consecutive ranks."""
    assert dist.is_initialized() and dist.get_world_size() == dims.world_size, "init the process group first"
    dp = init_device_mesh(device_type, (dims.world_size,), mesh_dim_names=("dp",))
    mesh2d = init_device_mesh(device_type, (dims.dp_mod_ep, dims.expert_parallel),
                              mesh_dim_names=("dp_mod_ep", "ep"))
    return dp, mesh2d["ep"], mesh2d["dp_mod_ep"]


def init_distributed(expert_parallel: int = 1, *, timeout_s: float = 600.0, backend: str | None = None,
                     num_experts: int | None = None) -> ParallelMesh:
    """Reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK, validates the mesh (every rank raises the same
    ValueError before any collective), joins the process group (NCCL on GPUs, gloo on CPUs) with a
    collective timeout and builds the meshes. `num_experts` (the model's) is checked against the EP degree."""
    world_size, rank, local_rank = _env_int("WORLD_SIZE", 1), _env_int("RANK", 0), _env_int("LOCAL_RANK", 0)
    dims = ParallelDims(world_size=world_size, expert_parallel=expert_parallel)
    if num_experts is not None:
        dims.check_experts(num_experts)
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    cuda = torch.cuda.is_available() and backend != "gloo"
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    if world_size == 1:
        return ParallelMesh(dims=dims, rank=0, local_rank=0, device=device)
    if not 0 <= rank < world_size:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world_size}")
    backend = backend or ("nccl" if cuda else "gloo")
    if cuda:
        torch.cuda.set_device(device)
        # a rank stuck in a collective raises at the timeout instead of hanging the job
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if not dist.is_initialized():
        dist.init_process_group(backend, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s),
                                device_id=device if cuda else None)
    dp, ep, dp_mod_ep = build_mesh(dims, device.type)
    return ParallelMesh(dims=dims, rank=rank, local_rank=local_rank, device=device, dp=dp, ep=ep, dp_mod_ep=dp_mod_ep)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
