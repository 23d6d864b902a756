"""Plain fp32 PyTorch log-probs: the reference every log-prob path is tested against.

It materialises the [N, V] logits (and their log_softmax): short and obviously right, never fast.
"""
import torch


def logprobs_reference(hidden, weight, targets, temperature: float = 1.0):
    """hidden [N, H], weight [V, H], targets [N] -> (logprobs, lse, entropy), each [N] fp32.

    logits = hidden @ weight.T / temperature; lse = logsumexp(logits); logprobs = logits[target] - lse;
    entropy = -sum p log p. Differentiable in hidden and weight (through plain autograd).
    """
    logits = hidden.float() @ weight.float().t() / temperature
    logp_all = torch.log_softmax(logits, dim=-1)
    logprobs = logp_all.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    lse = torch.logsumexp(logits, dim=-1)
    entropy = -(logp_all.exp() * logp_all).sum(-1)
    return logprobs, lse, entropy
