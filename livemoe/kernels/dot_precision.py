"""The input precision the Triton kernels' tl.dot uses for a dtype."""
import torch


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get a true fp32 product (the reference's: tf32 would cost ~1e-3 relative); 16-bit inputs are
    unaffected by the choice."""
    return "ieee" if dtype == torch.float32 else "tf32"
