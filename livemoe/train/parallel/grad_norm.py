"""Gradient-norm clipping for a model parallelized by livemoe.train.parallel.

torch.nn.utils.clip_grad_norm_ cannot mix the gradients of FSDP units on different meshes (dense weights on
`dp`, experts on `dp_mod_ep`). Every element of every parameter lives on exactly one rank here (FSDP splits
the dense tensors over all ranks; EP x dp_mod_ep splits the experts over all ranks), so the global squared
norm is one all-reduce of the ranks' local sums of squares.
"""
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor


def clip_grad_norm_(parameters, max_norm: float, group=None) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s L2 clipping (coefficient max_norm / (norm + 1e-6), at most 1) over
    all ranks of `group` (default: the world); returns the total norm (fp32), the same on every rank."""
    parameters = [p for p in parameters if p.grad is not None]
    if not any(isinstance(p.grad, DTensor) for p in parameters):  # one process: torch's own
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    assert all(isinstance(p.grad, DTensor) for p in parameters), "a parameter outside FSDP would count once per rank"
    locals_ = [p.grad.to_local() for p in parameters]
    device = locals_[0].device
    sq = torch.zeros((), device=device, dtype=torch.float32)
    for g in locals_:
        sq += g.float().pow(2).sum()
    dist.all_reduce(sq, group=group)
    total = sq.sqrt()
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for g in locals_:
        g.mul_(coef.to(g.dtype))
    return total
