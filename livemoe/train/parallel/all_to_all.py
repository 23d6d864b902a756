"""Differentiable all-to-all with uneven splits: the transport of the expert-parallel MoE layer.

The backward of a send with splits (send, recv) is the same collective with the splits swapped, so the
gradient of every row returns to the rank that sent it.
"""
import torch
import torch.distributed as dist


def _all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    out = x.new_empty((sum(recv_splits),) + tuple(x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), output_split_sizes=recv_splits, input_split_sizes=send_splits,
                           group=group)
    return out


class AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, send_splits, recv_splits, group):
        ctx.send_splits, ctx.recv_splits, ctx.group = send_splits, recv_splits, group
        return _all_to_all(x, send_splits, recv_splits, group)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.recv_splits, ctx.send_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, send_splits: list[int], recv_splits: list[int], group) -> torch.Tensor:
    """x [sum(send_splits), ...]: rows send_splits[r] go to rank r of `group`; returns [sum(recv_splits), ...]
    with the rows from rank r at recv_splits[r]'s place, in rank order."""
    assert len(send_splits) == len(recv_splits) == dist.get_world_size(group), (send_splits, recv_splits)
    assert x.shape[0] == sum(send_splits), (tuple(x.shape), send_splits)
    return AllToAll.apply(x, list(send_splits), list(recv_splits), group)
