"""livemoe kernels: each op beside its plain-PyTorch reference, with one dispatching entry per op.

Public entries: `livemoe.kernels.moe.fused_moe` (and `route`), `livemoe.kernels.fused_linear_logprobs`,
`livemoe.kernels.logprobs_from_logits`; paged attention lives in `livemoe.kernels.attention`.
"""
from livemoe.kernels.logprobs import fused_linear_logprobs, logprobs_from_logits

__all__ = ["fused_linear_logprobs", "logprobs_from_logits"]
