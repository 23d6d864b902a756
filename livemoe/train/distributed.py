"""What a trainer needs to run under torchrun, in one place: the mesh, this rank's share of a global batch,
sums over ranks, rank 0 alone writing, the model parallelized (livemoe.train.parallel) and exported gathered.

    torchrun --nproc_per_node N -m train.rft --expert_parallel E ...

`--batch_size` stays the global batch: every rank builds the same step (same data order, same seed) and keeps
its contiguous share, so a run's math does not depend on the number of ranks. One process without torchrun
gets world size 1, and every helper here is then the identity (today's path, unchanged).

Checkpoints (save_checkpoint, resolve_resume): livemoe.train.checkpoint's atomic saves; under torchrun every rank writes
its shards with torch.distributed.checkpoint, and a resume with any number of ranks reshards them.
"""
import dataclasses
import datetime
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from livemoe.train.parallel import ParallelMesh, clip_grad_norm_, destroy_distributed, init_distributed, parallelize


@dataclass
class Distributed:
    mesh: ParallelMesh
    own_group: Any = None  # side_channel(): a process group of its own for another thread's collectives

    @property
    def world_size(self) -> int:
        return self.mesh.dims.world_size

    @property
    def rank(self) -> int:
        return self.mesh.rank

    @property
    def is_main(self) -> bool:
        return self.mesh.is_main

    @property
    def group(self):
        """The data-parallel process group (all ranks), None in one process."""
        if self.own_group is not None:
            return self.own_group
        return self.mesh.dp.get_group() if self.mesh.distributed else None

    def side_channel(self, timeout_s: float = 600.0) -> "Distributed":
        """This one, its collectives on a process group of their own (gloo, every rank), for a second thread (the
        asynchronous rollout producer) whose gathers and barriers run while this thread's collectives (FSDP,
        expert parallel, the loss sums) do: on one group the two threads' calls would interleave in a different
        order on each rank. Python objects and barriers only (gloo: CPU tensors). Every rank calls it, in the
        same order (new_group is a collective); in one process it is this one."""
        if not self.mesh.distributed:
            return self
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        return dataclasses.replace(self, own_group=group)

    def local_share(self, items: list, what: str = "batch") -> list:
        """This rank's contiguous share of a global batch (the first len % world ranks take one more: the loss
        is normalised over the global batch, so uneven shares change nothing); ValueError when a rank would get
        nothing (it still has to join every collective of the step)."""
        if len(items) < self.world_size:
            raise ValueError(f"the {what} of {len(items)} sequences does not split over {self.world_size} ranks "
                             f"(each rank needs at least one)")
        n, extra = divmod(len(items), self.world_size)
        start = self.rank * n + min(self.rank, extra)
        return items[start:start + n + (self.rank < extra)]

    def check_batch_sizes(self, batch_size: int, num_examples: int) -> None:
        """ValueError, on every rank before any work, when a micro-batch (--batch_size, or the shorter last one of
        an epoch) would leave a rank without a sequence."""
        if not self.mesh.distributed:
            return
        tail = num_examples % batch_size
        for size, which in ((min(batch_size, num_examples), "--batch_size"),
                            (tail, "the last micro-batch of an epoch")):
            if 0 < size < self.world_size:
                raise ValueError(f"{which} has {size} sequences, fewer than the {self.world_size} ranks "
                                 f"(batch_size {batch_size}, {num_examples} examples): each rank needs at least one")

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of `value` over the ranks (a new tensor on value's device, no gradient)."""
        if not self.mesh.distributed:
            return value.detach().clone()
        total = value.detach().to(self.mesh.device, copy=True)  # NCCL reduces CUDA tensors only
        dist.all_reduce(total, group=self.group)
        return total.to(value.device)

    def sum_floats(self, *values: float) -> tuple:
        """Python numbers summed over the ranks (one all-reduce, float64); ints come back as ints."""
        total = self.sum(torch.tensor(values, dtype=torch.float64)).tolist()
        return tuple(int(t) if isinstance(v, int) else t for v, t in zip(values, total))

    def from_main(self, fn):
        """fn() run on rank 0 alone (a teacher, a judge: calls that cost money or write files), its result
        sent to every rank. When fn raises, every rank raises (the others with rank 0's message) instead of
        waiting for a result that never comes."""
        if not self.mesh.distributed:
            return fn()
        box, error = [None], None
        if self.is_main:
            try:
                box = [("ok", fn())]
            except Exception as e:  # noqa: BLE001  (re-raised below, after the others heard of it)
                error, box = e, [("error", f"{type(e).__name__}: {e}")]
        dist.broadcast_object_list(box, src=0, group=self.group)
        if error is not None:
            raise error
        kind, value = box[0]
        if kind == "error":
            raise RuntimeError(f"rank 0 failed: {value}")
        return value

    def all_gather_objects(self, obj) -> list:
        """Every rank's `obj` (picklable), in rank order."""
        if not self.mesh.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def checkpoint_view(self, state: dict):
        """Swaps, in place in `state` (model/optimizer state dicts keyed by parameter name), every expert-parallel
        tensor for a view of the same local memory as a shard of the whole experts tensor [E, ...] (EP rank j's
        experts at rows j * E/ep, then FSDP's rows of them), so a checkpoint holds the model's real shapes and
        loads into any other mesh or one process. Returns the function that swaps the originals back."""
        if not self.mesh.distributed or self.mesh.dims.expert_parallel == 1:
            return lambda: None
        from torch.distributed.tensor import DTensor, Shard

        mesh = self._ep_major_mesh()
        ep = self.mesh.dims.expert_parallel
        swapped = []

        def visit(tree: dict, path: str):
            for key, value in tree.items():
                if isinstance(value, dict):
                    visit(value, f"{path}{key}.")
                elif isinstance(value, DTensor) and ".mlp.experts." in f"{path}{key}":
                    shape = torch.Size((value.shape[0] * ep, *value.shape[1:]))
                    swapped.append((tree, key, value))
                    tree[key] = DTensor.from_local(value.to_local(), mesh, [Shard(0), Shard(0)], run_check=False,
                                                   shape=shape, stride=torch.empty(shape, device="meta").stride())

        visit(state, "")
        assert swapped, "expert parallel without expert tensors in the state dict"

        def restore():
            for tree, key, value in swapped:
                tree[key] = value
        return restore

    def _ep_major_mesh(self):
        """The ranks as an [ep, dp_mod_ep] mesh (build_mesh lays them out [dp_mod_ep, ep]): the order in which
        an expert tensor is split, first into EP ranks' experts, then by FSDP. Metadata only: no process groups."""
        from torch.distributed.device_mesh import DeviceMesh

        dims = self.mesh.dims
        ranks = torch.arange(dims.world_size).view(dims.dp_mod_ep, dims.expert_parallel).T.contiguous()
        return DeviceMesh(self.mesh.device.type, ranks, mesh_dim_names=("ep", "dp_mod_ep"), _init_backend=False,
                          _rank=self.rank)

    def save_checkpoint(self, root: str, step: int, model, optimizer, scheduler, trainer_state: dict,
                        keep_last: int, tokenizer=None, save_model=None) -> str:
        """livemoe.train.checkpoint's atomic save: the HF-layout one in one process, the sharded one (every rank writes
        its shards) under torchrun."""
        from livemoe.train import checkpoint

        if not self.mesh.distributed:
            return checkpoint.save_checkpoint(root, step, model, optimizer, scheduler, trainer_state,
                                              tokenizer=tokenizer, keep_last=keep_last, save_model=save_model)
        return checkpoint.save_sharded_checkpoint(root, step, model, optimizer, scheduler, trainer_state, self,
                                                  keep_last=keep_last)

    def resolve_resume(self, resume: str, root: str):
        """livemoe.train.checkpoint.resolve_resume on rank 0 alone (it verifies checksums and removes dead saves' temp
        dirs), its answer sent to every rank."""
        from livemoe.train.checkpoint import resolve_resume

        return self.from_main(lambda: resolve_resume(resume, root))

    def close(self) -> None:
        """Leaves the process group (after the last collective)."""
        destroy_distributed()

    def barrier(self) -> None:
        if self.mesh.distributed:
            dist.barrier(group=self.group)

    def parallelize(self, model, bf16: bool):
        """Expert parallel + FSDP2 (bf16 compute when `bf16`, fp32 master weights, gradients and AdamW
        states); build the optimizer after it."""
        dtype = torch.bfloat16 if bf16 else torch.float32
        return parallelize(model, self.mesh, param_dtype=dtype, reduce_dtype=torch.float32)

    def load_sharded(self, path: str, dtype: torch.dtype, bf16: bool):
        """parallelize(load_model(path)) with each rank building the model on the meta device and reading only
        its own shards from the checkpoint (livemoe.train.parallel.sharded_load): no rank holds the whole model."""
        from livemoe.train.parallel.sharded_load import load_sharded

        assert self.mesh.distributed, "one process loads with load_model"
        return load_sharded(path, self.mesh, dtype=dtype, param_dtype=torch.bfloat16 if bf16 else torch.float32)

    def device(self, default: torch.device) -> torch.device:
        """This rank's device under torchrun (cuda:LOCAL_RANK or the CPU), else `default`."""
        return self.mesh.device if self.mesh.distributed else default

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(list(parameters), max_norm, group=self.group)

    def full_tensors(self, model):
        """(name, whole tensor) of every parameter, gathered on every rank (experts from their EP group), on the
        mesh's device, one at a time. Every rank must iterate it to the end (it runs collectives)."""
        from torch.distributed.fsdp import FSDPModule

        for module in model.modules():  # a forward without backward (no_grad) leaves the root unit gathered
            if isinstance(module, FSDPModule):
                module.reshard()
        ep_group = self.mesh.ep.get_group() if self.mesh.dims.expert_parallel > 1 else None
        for name, param in model.named_parameters():
            # gathered over its FSDP mesh (a plain parameter in one process: a --rollout_dtype copy)
            t = (param.full_tensor() if hasattr(param, "full_tensor") else param).detach()
            if ep_group is not None and ".mlp.experts." in name:
                parts = [torch.empty_like(t) for _ in range(self.mesh.dims.expert_parallel)]
                dist.all_gather(parts, t.contiguous(), group=ep_group)
                t = torch.cat(parts)
            yield name, t

    def full_state_dict(self, model) -> dict | None:
        """Every parameter gathered whole (experts from their EP group) on rank 0, on the CPU; None on the others.
        Every rank must call it (it runs collectives)."""
        if not self.mesh.distributed:
            return {name: t.detach().cpu() for name, t in model.state_dict().items()}
        full = {name: t.cpu() for name, t in self.full_tensors(model)}
        return full if self.is_main else None

    def inference_copy(self, model, dtype: torch.dtype):
        """A plain one-device model in `dtype` holding `model`'s whole weights, on every rank: what each rank's
        rollout decoder runs (refresh it with refresh_copy after each optimizer step)."""
        from livemoe.engine.model.loader import empty_model

        copy = empty_model(model.config, dtype, self.mesh.device)
        self.refresh_copy(model, copy)
        return copy.eval().requires_grad_(False)

    @torch.no_grad()
    def refresh_copy(self, model, copy) -> None:
        """copy's weights := model's, gathered layer by layer (in place: a decoder on `copy` sees its parameters'
        versions change and drops its cached prefixes)."""
        target = dict(copy.named_parameters())
        for name, t in self.full_tensors(model):
            target[name].copy_(t)

    def export(self, model, path: str, tokenizer=None) -> None:
        """The model gathered and saved once, by rank 0, in the Hugging Face layout engine.load_model reads."""
        from livemoe.engine import save_model

        state = self.full_state_dict(model)
        if self.is_main:
            save_model(self.unsharded(model, state), path, tokenizer=tokenizer)
        self.barrier()

    def unsharded(self, model, state: dict):
        """A plain one-device model holding `state` (full_state_dict's), or `model` itself in one process."""
        if not self.mesh.distributed:
            return model
        from livemoe.engine.model.qwen3 import Qwen3ForCausalLM

        with torch.device("meta"):  # no memory, no init: the gathered tensors are assigned below
            plain = Qwen3ForCausalLM(model.config)
        plain.load_state_dict(state, assign=True)
        plain.init_nonpersistent_buffers("cpu")  # its buffers are not in a state dict
        return plain


class _NoMetrics:
    """What ranks other than 0 log to: nothing."""

    def log(self, step: int, **metrics) -> None:
        pass

    def close(self, plot: bool = True) -> None:
        pass


def metrics_logger(d: Distributed, *args, **kwargs):
    """livemoe.train.metrics.MetricsLogger on rank 0; a logger that writes nothing on the others."""
    from livemoe.train.metrics import MetricsLogger

    return MetricsLogger(*args, **kwargs) if d.is_main else _NoMetrics()


def single_process() -> Distributed:
    """World size 1, whatever the environment says (a trainer function called directly)."""
    from livemoe.train.parallel import ParallelDims, ParallelMesh

    return Distributed(ParallelMesh(dims=ParallelDims(world_size=1), rank=0, local_rank=0, device=torch.device("cpu")))


def world_size() -> int:
    """The job's world size from torchrun's environment (1 without torchrun)."""
    import os

    return int(os.environ.get("WORLD_SIZE", "1"))


def setup_trainer(cfg, output_dir: str, model: str | None = None) -> Distributed:
    """setup() for a trainer's config: refuses, on every rank before any work, a global batch smaller than the
    world size, checks the EP degree against the model's experts, turns progress bars off on ranks other
    than 0, and has rank 0 record the mesh in output_dir/parallel.json (world_size, expert_parallel,
    data-parallel sizes) beside config.yaml. `model`: the checkpoint whose experts are checked (default
    cfg.model; "" skips the check: a model not resolved yet, in one process)."""
    import json
    import os

    from livemoe.engine.model.config import load_config

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and cfg.batch_size < world_size:
        raise ValueError(f"--batch_size {cfg.batch_size} (the global batch) is smaller than the world size "
                         f"{world_size}: each rank needs at least one sequence")
    backend = "gloo" if cfg.device == "cpu" else None
    model = cfg.model if model is None else model
    num_experts = load_config(model).num_experts if model else None
    d = setup(cfg.expert_parallel, num_experts=num_experts, backend=backend)
    if not d.is_main:
        cfg.progress = False  # rank 0 alone draws progress bars
    if d.is_main:
        os.makedirs(output_dir, exist_ok=True)
        with open(os.path.join(output_dir, "parallel.json"), "w") as f:
            json.dump(d.mesh.dims.to_dict(), f, indent=1)
    return d


def setup(expert_parallel: int = 1, *, timeout_s: float = 600.0, num_experts: int | None = None,
          backend: str | None = None) -> Distributed:
    """The job's mesh from torchrun's environment. On ranks other than 0, stdout goes to /dev/null (rank 0 alone
    prints and draws progress bars); stderr stays, so every rank's errors are seen."""
    mesh = init_distributed(expert_parallel, timeout_s=timeout_s, num_experts=num_experts, backend=backend)
    if not mesh.is_main:
        sys.stdout = open("/dev/null", "w")  # noqa: SIM115  (for the life of the process)
    return Distributed(mesh)
