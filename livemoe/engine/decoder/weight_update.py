"""One weight update as every rank of an engine is told it, and how a rank stages its part of it
(livemoe.engine.model.weights checks, then holds what each parameter of this rank will receive).

    tensors  a caller's (name, tensor) pairs: rank 0 holds them; in a tensor-parallel engine it broadcasts them
             over the ranks' group and each worker keeps its slices
    disk     a checkpoint directory: every rank reads only its slices (safetensors get_slice)
    group    the trainer's broadcast over the weight-update group (init_weights_update_group), which every rank
             of every replica joined: each keeps its slices of each bucket as it arrives

A tensor-parallel engine applies an update only when every rank staged its part (DriverRunner.load_weights):
a refused update leaves every rank's old weights whole.
"""
from dataclasses import dataclass

import torch.distributed as dist

from livemoe.engine.core.weight_sync import dtype_name, receive_buckets
from livemoe.engine.model.weights import Staged, stage_weights, stage_weights_from_disk

SOURCES = ("tensors", "disk", "group")


@dataclass(frozen=True)
class WeightUpdate:
    source: str
    path: str | None = None  # disk
    names: tuple = ()  # tensors, group: in the order they are broadcast
    dtypes: tuple = ()
    shapes: tuple = ()

    def __post_init__(self):
        assert self.source in SOURCES, self.source

    @classmethod
    def of_tensors(cls, named_tensors: list) -> "WeightUpdate":
        """A caller's tensors, as the workers will receive them."""
        return cls("tensors", names=tuple(n for n, _ in named_tensors),
                   dtypes=tuple(dtype_name(t.dtype) for _, t in named_tensors),
                   shapes=tuple(tuple(t.shape) for _, t in named_tensors))

    @property
    def where(self) -> str:
        return {"tensors": "update_weights", "disk": str(self.path),
                "group": "update_weights_from_distributed"}[self.source]


def stage_update(model, update: WeightUpdate, receiver=None, device=None) -> Staged:
    """This rank's part of an update it does not hold the tensors of (a worker's "tensors": rank 0's broadcast
    over the default group, the model's own)."""
    if update.source == "disk":
        assert update.path is not None
        return stage_weights_from_disk(model, update.path)
    if update.source == "group":
        if receiver is None:
            raise RuntimeError("no weight-update group: POST /init_weights_update_group first")
        pairs = receiver.receive(list(update.names), list(update.dtypes), [list(s) for s in update.shapes], device)
    else:
        pairs = receive_buckets(dist.group.WORLD, list(update.names), list(update.dtypes),
                                [list(s) for s in update.shapes], device)
    return stage_weights(model, pairs, update.where, dict(zip(update.names, map(tuple, update.shapes))))
