"""The input check the exact Triton entries share (the C++ ops make the same one with TORCH_CHECK)."""
import torch


def same_dtype(op: str, **tensors: torch.Tensor) -> None:
    """ValueError naming the op and its tensors' dtypes when they differ: the kernels read every operand as stored,
    and a cast here would be another rounding the other side of the exact mode does not make."""
    dtypes = {name: t.dtype for name, t in tensors.items()}
    if len(set(dtypes.values())) > 1:
        listed = ", ".join(f"{name} {str(dtype).removeprefix('torch.')}" for name, dtype in dtypes.items())
        raise ValueError(f"{op}: the operands must share a dtype, got {listed}")
