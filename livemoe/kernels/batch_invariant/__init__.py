"""The exact on-policy mode's kernels: batch-invariant forwards, so that a token's values have the same bits in
the decoder (a decode step, a prefill chunk, a prefix-cache hit, any batch) and in the trainer's forward (any
batch), and the decoder's log-probs of sampled tokens equal the trainer's exactly.

Every op a token's value depends on has one fixed reduction order that looks at the token's own row (and, for
attention, its own context, key by key in position order): matmul (each output one dot product, never a BLAS
that blocks by the batch's size), RMSNorm, rotary, SiLU, attention (one per-query kernel serves decode, chunked
prefill and the trainer's causal batch), the router's softmax and top-k, the experts and their weighted sum (in
the top-k order), and the log-softmax of the logits. Forward values only: a trainer's gradients are the ordinary
formulas' (`exact`). On the CPU the C++ ops of csrc/batch_invariant.cpp; on CUDA the Triton kernels of this
package, one module per op (linear, rms_norm, silu_mul, rope, attention, route, experts, log_softmax), each with
tiles that depend on the model's shapes and dtype alone, never on the number of rows (no split-K, no split-KV).

Switched on per forward by `batch_invariant_mode()` (mode.py); the dispatchers of livemoe.kernels and the model's
layers read `enabled()`. docs/training.md ("Exact on-policy mode") has the contract and the cost.
"""
from livemoe.kernels.batch_invariant.mode import batch_invariant_mode, current, enabled, unavailable_reason

__all__ = ["batch_invariant_mode", "current", "enabled", "unavailable_reason"]
