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

from engine.parallel import ParallelMesh, clip_grad_norm_, init_distributed, parallelize


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
        """This rank's contiguous share of a global batch; ValueError (the same on every rank, before any
        work) when it does not split evenly."""
        if len(items) % self.world_size:
            raise ValueError(f"the {what} of {len(items)} sequences does not split over {self.world_size} ranks "
                             f"(make it a multiple of the world size)")
        n = len(items) // self.world_size
        return items[self.rank * n:(self.rank + 1) * n]

    def sum(self, value: torch.Tensor) -> torch.Tensor:
        """The sum of `value` over the ranks (a new tensor, no gradient)."""
        value = value.detach().clone()
        if self.mesh.distributed:
            dist.all_reduce(value, group=self.group)
        return value

    def from_main(self, fn):
        """fn() run on rank 0 alone (a teacher, a judge: calls that cost money or write files), its result
        sent to every rank."""
        if not self.mesh.distributed:
            return fn()
        box = [fn() if self.is_main else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def barrier(self) -> None:
        if self.mesh.distributed:
            dist.barrier(group=self.group)

    def parallelize(self, model, bf16: bool):
        """Expert parallel + FSDP2 (bf16 compute when `bf16`, fp32 master weights, gradients and AdamW
        states); build the optimizer after it."""
        dtype = torch.bfloat16 if bf16 else torch.float32
        return parallelize(model, self.mesh, param_dtype=dtype, reduce_dtype=torch.float32)

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


def setup(expert_parallel: int = 1, *, timeout_s: float = 600.0, num_experts: int | None = None) -> Distributed:
    """The job's mesh from torchrun's environment. On ranks other than 0, stdout goes to /dev/null (rank 0 alone
    prints and draws progress bars); stderr stays, so every rank's errors are seen."""
    mesh = init_distributed(expert_parallel, timeout_s=timeout_s, num_experts=num_experts)
    if not mesh.is_main:
        sys.stdout = open("/dev/null", "w")  # noqa: SIM115  (for the life of the process)
    return Distributed(mesh)
