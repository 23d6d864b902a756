"""Routing align's dispatch (the contract and the reference: align_reference.py): the Triton op on CUDA, the
C++ op on the CPU when built, else the reference."""
import torch

from livemoe.kernels import _ext
from livemoe.kernels.moe.align_reference import moe_align_reference


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_size: int):
    """Dispatch: the Triton op on CUDA (no host sync), the C++ op on the CPU when built, else the reference."""
    if topk_ids.device.type == "cuda":
        from livemoe.kernels.moe.align_triton import moe_align_triton  # Triton: a CPU install may have none

        return moe_align_triton(topk_ids, num_experts, block_size)
    if topk_ids.device.type == "cpu" and _ext.has_op("moe_align"):
        return _ext.op("moe_align")(topk_ids, num_experts, block_size)
    return moe_align_reference(topk_ids, num_experts, block_size)
