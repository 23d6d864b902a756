"""Chunked PyTorch log-probs (the CPU path): the same tiling as the Triton kernels, in torch ops.

Tokens go in chunks of `chunk_tokens`, the vocabulary in chunks of `chunk_vocab`: the working set is a
few [chunk_tokens, chunk_vocab] fp32 tiles, never [N, V]. The forward keeps an online logsumexp over
the vocabulary chunks (running max m, sum l = sum exp(s - m), and for the entropy
e = sum exp(s - m) * (s - m), kept relative to m so that huge logits do not cancel). The backward
recomputes each tile's logits from lse and the entropy it saved, so nothing of size V is kept.

Per token, with s = z / T the scaled logits, p = softmax(s), log p_k = s_k - lse and upstream
gradients g_lp (log-prob), g_lse, g_H (entropy):
    d s_k = g_lp * [k == target] + p_k * (a + b * log p_k),   a = g_lse - g_lp - g_H * H,  b = -g_H
and d z = d s / T, d hidden = d z @ W, d W = d z^T @ hidden.
"""
import torch

NEG_INIT = -1e30  # running-max start: finite, so (m_old - m_new) * 0 stays 0 where -inf would give nan


def forward(hidden, weight, targets, inv_temp: float, with_entropy: bool, chunk_tokens: int, chunk_vocab: int):
    """-> (logprobs, lse, entropy or None), each [N] fp32. No autograd here."""
    n, v = hidden.shape[0], weight.shape[0]
    logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
    lse = torch.empty_like(logprobs)
    entropy = torch.empty_like(logprobs) if with_entropy else None
    for n0 in range(0, n, chunk_tokens):
        n1 = min(n, n0 + chunk_tokens)
        h = hidden[n0:n1].float()
        tgt = targets[n0:n1]
        m = torch.full((n1 - n0,), NEG_INIT, dtype=torch.float32, device=h.device)
        l = torch.zeros_like(m)
        e = torch.zeros_like(m)
        t = torch.zeros_like(m)
        for v0 in range(0, v, chunk_vocab):
            v1 = min(v, v0 + chunk_vocab)
            s = (h @ weight[v0:v1].float().t()).mul_(inv_temp)
            hit = (tgt >= v0) & (tgt < v1)
            t += torch.where(hit, s.gather(1, (tgt - v0).clamp(0, v1 - v0 - 1).unsqueeze(1)).squeeze(1), 0.0)
            m_new = torch.maximum(m, s.amax(1))
            alpha = torch.exp(m - m_new)
            c = s.sub_(m_new.unsqueeze(1))  # s - m_new, in place
            p = torch.exp(c)
            if with_entropy:
                e = alpha * (e + (m - m_new) * l) + (p * c).sum(1)
            l = l * alpha + p.sum(1)
            m = m_new
        log_l = torch.log(l)
        lse[n0:n1] = m + log_l
        logprobs[n0:n1] = t - lse[n0:n1]
        if with_entropy:
            entropy[n0:n1] = log_l - e / l
    return logprobs, lse, entropy


def token_coefficients(g_logprobs, g_lse, g_entropy, entropy, inv_temp: float):
    """Per-token (g_lp, a, b) of the formula above, each scaled by 1/T so that d z comes out directly.
    Any upstream gradient may be None (that output was not used)."""
    zero = None
    for g in (g_logprobs, g_lse, g_entropy):
        if g is not None:
            zero = torch.zeros_like(g, dtype=torch.float32)
            break
    assert zero is not None, "backward called with no upstream gradient"
    g_lp = zero if g_logprobs is None else g_logprobs.float()
    a = (zero if g_lse is None else g_lse.float()) - g_lp
    b = None
    if g_entropy is not None:
        a = a - g_entropy.float() * entropy
        b = -g_entropy.float() * inv_temp
    return g_lp * inv_temp, a * inv_temp, b


def backward(hidden, weight, targets, inv_temp: float, lse, g_lp, a, b, chunk_tokens: int, chunk_vocab: int,
             need_dhidden: bool, need_dweight: bool):
    """d hidden [N, H] (hidden's dtype) and d weight [V, H] (weight's dtype, accumulated in fp32)."""
    n, v = hidden.shape[0], weight.shape[0]
    dhidden = torch.empty_like(hidden) if need_dhidden else None
    dweight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_dweight else None
    for n0 in range(0, n, chunk_tokens):
        n1 = min(n, n0 + chunk_tokens)
        h = hidden[n0:n1].float()
        tgt = targets[n0:n1]
        dh = torch.zeros_like(h) if need_dhidden else None
        lse_c, gl_c, a_c = lse[n0:n1, None], g_lp[n0:n1], a[n0:n1, None]
        b_c = None if b is None else b[n0:n1, None]
        for v0 in range(0, v, chunk_vocab):
            v1 = min(v, v0 + chunk_vocab)
            w = weight[v0:v1].float()
            c = (h @ w.t()).mul_(inv_temp).sub_(lse_c)  # log p
            dz = torch.exp(c)
            dz = dz.mul_(a_c) if b_c is None else dz.mul_(c.mul_(b_c).add_(a_c))
            hit = (tgt >= v0) & (tgt < v1)
            idx = (tgt - v0).clamp(0, v1 - v0 - 1).unsqueeze(1)
            dz.scatter_add_(1, idx, torch.where(hit, gl_c, 0.0).unsqueeze(1))
            if need_dhidden:
                dh.addmm_(dz, w)
            if need_dweight:
                dweight[v0:v1].addmm_(dz.t(), h)
        if need_dhidden:
            dhidden[n0:n1] = dh
    if need_dweight:
        dweight = dweight.to(weight.dtype)
    return dhidden, dweight
