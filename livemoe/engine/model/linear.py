"""The model's linear layers: nn.Linear, whose forward takes the batch-invariant kernel in the exact mode
(livemoe.kernels.batch_invariant), and `linear`, the same choice for a bare weight (the lm_head's logits). Outside
it, a bias-free linear takes livemoe.kernels.linear (the C++ GEMV for 16-bit weights at decode sizes)."""
import torch
import torch.nn.functional as F
from torch import nn

from livemoe.kernels import batch_invariant
from livemoe.kernels.batch_invariant import ops as exact_ops
from livemoe.kernels.linear import linear as decode_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    if batch_invariant.enabled():
        return exact_ops.exact(exact_ops.linear_forward, F.linear, x, weight, bias)
    return F.linear(x, weight, bias) if bias is not None else decode_linear(x, weight)


class Linear(nn.Linear):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
