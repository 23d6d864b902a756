"""What a trainer needs to run under torchrun, in one place: the mesh, this rank's share of a global batch,
sums over ranks, rank 0 alone writing, the model parallelized (engine.parallel) and exported gathered.

    torchrun --nproc_per_node N -m train.rft --expert_parallel E ...

`--batch_size` stays the global batch: every rank builds the same step (same data order, same seed) and keeps
its contiguous share, so a run's math does not depend on the number of ranks. One process without torchrun
gets world size 1, and every helper here is then the identity (today's path, unchanged).
"""
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from engine.parallel import ParallelMesh, clip_grad_norm_, destroy_distributed, init_distributed, parallelize


@dataclass
class Distributed:
    mesh: ParallelMesh

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
        return self.mesh.dp.get_group() if self.mesh.distributed else None

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

    def device(self, default: torch.device) -> torch.device:
        """This rank's device under torchrun (cuda:LOCAL_RANK or the CPU), else `default`."""
        return self.mesh.device if self.mesh.distributed else default

    def clip_grad_norm_(self, parameters, max_norm: float) -> torch.Tensor:
        return clip_grad_norm_(list(parameters), max_norm, group=self.group)

    def full_state_dict(self, model) -> dict | None:
        """Every parameter gathered whole (experts from their EP group) on rank 0, on the CPU; None on the others.
        Every rank must call it (it runs collectives)."""
        if not self.mesh.distributed:
            return {name: t.detach().cpu() for name, t in model.state_dict().items()}
        full = {}
        ep_group = self.mesh.ep.get_group() if self.mesh.dims.expert_parallel > 1 else None
        for name, param in model.named_parameters():
            t = param.full_tensor().detach()  # gathered over its FSDP mesh
            if ep_group is not None and ".mlp.experts." in name:
                parts = [torch.empty_like(t) for _ in range(self.mesh.dims.expert_parallel)]
                dist.all_gather(parts, t.contiguous(), group=ep_group)
                t = torch.cat(parts)
            if self.is_main:
                full[name] = t.cpu()
        return full if self.is_main else None

    def export(self, model, path: str, tokenizer=None) -> None:
        """The model gathered and saved once, by rank 0, in the Hugging Face layout engine.load_model reads."""
        from engine import save_model

        state = self.full_state_dict(model)
        if self.is_main:
            save_model(self.unsharded(model, state), path, tokenizer=tokenizer)
        self.barrier()

    def unsharded(self, model, state: dict):
        """A plain one-device model holding `state` (full_state_dict's), or `model` itself in one process."""
        if not self.mesh.distributed:
            return model
        from engine.layers import RotaryEmbedding
        from engine.model import Qwen3ForCausalLM

        cfg = model.config
        with torch.device("meta"):  # no memory, no init: the gathered tensors are assigned below
            plain = Qwen3ForCausalLM(cfg)
        plain.load_state_dict(state, assign=True)
        plain.model.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta)  # its buffer is not in a state dict
        return plain


class _NoMetrics:
    """What ranks other than 0 log to: nothing."""

    def log(self, step: int, **metrics) -> None:
        pass

    def close(self, plot: bool = True) -> None:
        pass


def metrics_logger(d: Distributed, *args, **kwargs):
    """train.metrics.MetricsLogger on rank 0; a logger that writes nothing on the others."""
    from train.metrics import MetricsLogger

    return MetricsLogger(*args, **kwargs) if d.is_main else _NoMetrics()


def require_one_process(command: str) -> None:
    """ValueError for a trainer not wired for torchrun yet: N ranks would each run the whole job and write the
    same output dir."""
    import os

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1:
        raise ValueError(f"{command} does not run under torchrun yet (WORLD_SIZE={world_size}); run it as one "
                         "process (train.rft runs on many ranks)")


def single_process() -> Distributed:
    """World size 1, whatever the environment says (a trainer function called directly)."""
    from engine.parallel import ParallelDims, ParallelMesh

    return Distributed(ParallelMesh(dims=ParallelDims(world_size=1), rank=0, local_rank=0, device=torch.device("cpu")))


def setup_trainer(cfg, output_dir: str) -> Distributed:
    """setup() for a trainer's config: refuses, on every rank before any work, what does not run under
    torchrun yet, checks the EP degree against the model's experts, turns progress bars off on ranks other
    than 0, and has rank 0 record the mesh in output_dir/parallel.json (world_size, expert_parallel,
    data-parallel sizes) beside config.yaml."""
    import json
    import os

    from engine.config import load_config

    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size > 1 and cfg.resume != "none":
        raise ValueError(f"--resume {cfg.resume}: checkpoints under torchrun (world size {world_size}) need sharded "
                         "torch.distributed.checkpoint saves, which this trainer does not write yet")
    if world_size > 1 and cfg.batch_size < world_size:
        raise ValueError(f"--batch_size {cfg.batch_size} (the global batch) is smaller than the world size "
                         f"{world_size}: each rank needs at least one sequence")
    if world_size > 1 and cfg.save_every:
        raise ValueError(f"--save_every {cfg.save_every}: checkpoints under torchrun (world size {world_size}) "
                         "are not written yet; the final model is exported to final/")
    backend = "gloo" if cfg.device == "cpu" else None
    d = setup(cfg.expert_parallel, num_experts=load_config(cfg.model).num_experts, backend=backend)
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
