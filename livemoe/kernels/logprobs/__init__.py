"""Log-probs of target tokens without [tokens x vocab] logits.

`fused_linear_logprobs(hidden, weight, targets, temperature)` goes from the final hidden states and
the lm_head weight straight to fp32 log-probs (optionally lse and entropy), tiled over tokens and
vocabulary: Triton on CUDA, chunked PyTorch on the CPU, `logprobs_reference` (plain fp32) to test
them against. `logprobs_from_logits` is the entry for logits that already exist.
"""
from livemoe.kernels.logprobs.api import fused_linear_logprobs, logprobs_from_logits
from livemoe.kernels.logprobs.reference import logprobs_reference

__all__ = ["fused_linear_logprobs", "logprobs_from_logits", "logprobs_reference"]
