"""logprobs_from_logits: target log-probs from logits that already exist, without an fp32 copy of them.

log_softmax(logits.float() / T).gather(target) done row-chunk by row-chunk: the working set is one
chunk in fp32; the backward writes d logits (which autograd needs anyway, in the logits' dtype) chunk
by chunk from the saved lse.
"""
import torch

CHUNK_ELEMENTS = 1 << 22  # fp32 elements per row chunk (16 MiB)


class LogprobsFromLogits(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, temperature: float):
        n, v = logits.shape
        rows = max(1, CHUNK_ELEMENTS // max(v, 1))
        logprobs = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty_like(logprobs)
        for r0 in range(0, n, rows):
            s = logits[r0:r0 + rows].float() / temperature
            lse[r0:r0 + rows] = torch.logsumexp(s, dim=-1)
            logprobs[r0:r0 + rows] = s.gather(1, targets[r0:r0 + rows].unsqueeze(1)).squeeze(1) - lse[r0:r0 + rows]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature, ctx.rows = temperature, rows
        return logprobs

    @staticmethod
    def backward(ctx, g):
        logits, targets, lse = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None
        inv_temp = 1.0 / ctx.temperature
        grad = torch.empty_like(logits)
        for r0 in range(0, logits.shape[0], ctx.rows):
            r1 = r0 + ctx.rows
            gs = g[r0:r1, None].float() * inv_temp
            p = torch.exp(logits[r0:r1].float() * inv_temp - lse[r0:r1, None])
            d = (-p).mul_(gs).scatter_add_(1, targets[r0:r1].unsqueeze(1), gs)
            grad[r0:r1] = d
        return grad, None, None
