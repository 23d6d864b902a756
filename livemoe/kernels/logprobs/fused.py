"""fused_linear_logprobs: per-token log-prob of the target under softmax(hidden @ weight.T / T), never
materialising [N, V]. One autograd.Function, forward and backward side by side; the backend (Triton
on CUDA, chunked PyTorch on the CPU) does the tile work.
"""
from dataclasses import dataclass

import torch

from livemoe.kernels.logprobs import chunked


@dataclass(frozen=True, slots=True)
class LogprobsOptions:
    backend: str  # "triton" | "chunked"
    chunk_tokens: int
    chunk_vocab: int  # Triton: the backward's vocabulary chunk (its forward tiles the vocabulary itself)
    fp32_accumulation: bool  # Triton: partial sums of d hidden / d weight kept in fp32
    with_entropy: bool
    vocab_splits: int | None = None  # Triton forward; None = fill the GPU


class FusedLinearLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, n_valid, temperature: float, opts: LogprobsOptions):
        inv_temp = 1.0 / temperature
        if opts.backend == "triton":
            from livemoe.kernels.logprobs import triton_logprobs

            logprobs, lse, entropy = triton_logprobs.forward(hidden, weight, targets, n_valid, inv_temp,
                                                             opts.with_entropy, opts.vocab_splits)
        else:
            assert n_valid is None, "the chunked path gets only active rows"
            logprobs, lse, entropy = chunked.forward(hidden, weight, targets, inv_temp, opts.with_entropy,
                                                     opts.chunk_tokens, opts.chunk_vocab)
        if entropy is None:
            entropy = lse.new_zeros(0)
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(hidden, weight, targets, lse, entropy, n_valid)
        ctx.inv_temp, ctx.opts = inv_temp, opts
        return logprobs, lse, entropy

    @staticmethod
    def backward(ctx, g_logprobs, g_lse, g_entropy):
        hidden, weight, targets, lse, entropy, n_valid = ctx.saved_tensors
        opts, inv_temp = ctx.opts, ctx.inv_temp
        if not opts.with_entropy:
            g_entropy = None
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if (g_logprobs is None and g_lse is None and g_entropy is None) or not (need_dh or need_dw):
            return None, None, None, None, None, None
        g_lp, a, b = chunked.token_coefficients(g_logprobs, g_lse, g_entropy, entropy, inv_temp)
        if opts.backend == "triton":
            from livemoe.kernels.logprobs import triton_logprobs

            dh, dw = triton_logprobs.backward(hidden, weight, targets, n_valid, inv_temp, lse, g_lp.contiguous(),
                                              a.contiguous(), None if b is None else b.contiguous(),
                                              opts.chunk_tokens, opts.chunk_vocab, need_dh, need_dw,
                                              opts.fp32_accumulation)
        else:
            dh, dw = chunked.backward(hidden, weight, targets, inv_temp, lse, g_lp, a, b, opts.chunk_tokens,
                                      opts.chunk_vocab, need_dh, need_dw)
        return dh, dw, None, None, None, None
