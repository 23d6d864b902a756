"""Chunked PyTorch log-probs (the CPU path): the same tiling as the Triton kernels, in torch ops.

Tokens go in chunks of `chunk_tokens`, the vocabulary in chunks of `chunk_vocab`: the working set is a
few [chunk_tokens, chunk_vocab] fp32 tiles, never [N, V]. The forward merges per-chunk logsumexps
(and entropy terms, see `forward`); the backward recomputes each tile's logits from lse and the entropy it saved, so nothing of size V is kept.
Tiles are small enough to stay in cache, so their several elementwise passes cost less than eager's
passes over [N, V] in memory.

Per token, with s = z / T the scaled logits, p = softmax(s), log p_k = s_k - lse and upstream
gradients g_lp (log-prob), g_lse, g_H (entropy):
    d s_k = g_lp * [k == target] + p_k * (a + b * log p_k),   a = g_lse - g_lp - g_H * H,  b = -g_H
and d z = d s / T, d hidden = d z @ W, d W = d z^T @ hidden.
"""
import os
from concurrent.futures import ThreadPoolExecutor

import torch


def forward(hidden, weight, targets, inv_temp: float, with_entropy: bool, chunk_tokens: int, chunk_vocab: int):
    """-> (logprobs, lse, entropy or None), each [N] fp32. No autograd here.

    Per vocabulary chunk c: lse_c = logsumexp(s_c) and, for the entropy, q_c = sum p log p of the
    chunk's own softmax. Chunks merge as lse = logsumexp_c(lse_c) and
    sum p log p = sum_c w_c * (q_c + lse_c - lse) with w_c = exp(lse_c - lse): every term is relative,
    so logits of 1e4 lose nothing to cancellation. Each worker owns a range of vocabulary chunks.
    """
    n, v = hidden.shape[0], weight.shape[0]
    starts = list(range(0, v, chunk_vocab))
    lse_parts = torch.empty((len(starts), n), dtype=torch.float32, device=hidden.device)  # a few floats/token
    plogp_parts = torch.empty_like(lse_parts) if with_entropy else None
    workers = _split(len(starts))
    target_logit = torch.zeros((len(workers), n), dtype=torch.float32, device=hidden.device)

    def work(w, chunk_ids):
        for n0 in range(0, n, chunk_tokens):
            n1 = min(n, n0 + chunk_tokens)
            h = _scaled(hidden[n0:n1], inv_temp)
            tgt = targets[n0:n1]
            for ci in chunk_ids:
                v0 = starts[ci]
                v1 = min(v, v0 + chunk_vocab)
                s = h @ weight[v0:v1].float().t()
                hit = (tgt >= v0) & (tgt < v1)
                idx = (tgt - v0).clamp(0, v1 - v0 - 1).unsqueeze(1)
                target_logit[w, n0:n1] += torch.where(hit, s.gather(1, idx).squeeze(1), 0.0)
                # one fused log_softmax pass (torch.logsumexp is several unfused ops on the CPU); the
                # chunk's lse is read back from its first column: lse = s_0 - log p_0
                c = torch.log_softmax(s, 1)
                lse_parts[ci, n0:n1] = s[:, 0] - c[:, 0]
                if with_entropy:
                    plogp_parts[ci, n0:n1] = (torch.exp(c) * c).sum(1)

    _run(work, workers)
    lse = torch.logsumexp(lse_parts, 0)
    logprobs = target_logit.sum(0) - lse
    entropy = None
    if with_entropy:
        rel = lse_parts - lse
        entropy = -(torch.exp(rel) * (plogp_parts + rel)).sum(0)
    return logprobs, lse, entropy


def _split(num_chunks: int) -> list[list[int]]:
    """Vocabulary chunks per worker (interleaved, for balance), one worker per intra-op thread."""
    workers = max(1, min(torch.get_num_threads(), num_chunks))
    return [list(range(num_chunks))[i::workers] for i in range(workers)]


def _run(work, workers) -> None:
    """work(i, chunk_ids) for every worker: in threads, each op single-threaded (torch's intra-op thread
    count is 1 for the duration of the call). Many small tiles with an intra-op barrier each stall on a
    busy machine; independent workers do not."""
    def run_one(i, ids):
        with torch.no_grad():  # grad mode is per thread: the pool's threads would record a graph
            work(i, ids)

    if len(workers) == 1:
        run_one(0, workers[0])
        return
    global _POOL, _POOL_PID
    if _POOL is None or _POOL_PID != os.getpid() or _POOL._max_workers < len(workers):
        _POOL = ThreadPoolExecutor(len(workers), thread_name_prefix="livemoe-logprobs")
        _POOL_PID = os.getpid()  # a forked child (a data-loader worker) has none of the parent's threads
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for f in [_POOL.submit(run_one, i, ids) for i, ids in enumerate(workers)]:
            f.result()
    finally:
        torch.set_num_threads(threads)


_POOL: ThreadPoolExecutor | None = None  # kept: starting threads per call costs more than a small step
_POOL_PID = 0


def _scaled(h, inv_temp: float):
    """fp32 rows with 1/T folded in (one [n, H] multiply instead of one per logit)."""
    h = h.float()
    return h * inv_temp if inv_temp != 1.0 else h


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
    """d hidden [N, H] (hidden's dtype) and d weight [V, H] (weight's dtype, accumulated in fp32).
    Each worker owns a range of vocabulary chunks (so its rows of d weight) and its own d hidden sum."""
    n, v = hidden.shape[0], weight.shape[0]
    starts = list(range(0, v, chunk_vocab))
    workers = _split(len(starts))
    dh_parts = torch.zeros((len(workers),) + tuple(hidden.shape), dtype=torch.float32, device=hidden.device) \
        if need_dhidden else None
    dweight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_dweight else None

    def work(wi, chunk_ids):
        for n0 in range(0, n, chunk_tokens):
            n1 = min(n, n0 + chunk_tokens)
            h = hidden[n0:n1].float()
            hs = _scaled(h, inv_temp)
            tgt = targets[n0:n1]
            lse_c, gl_c, a_c = lse[n0:n1, None], g_lp[n0:n1], a[n0:n1, None]
            b_c = None if b is None else b[n0:n1, None]
            for ci in chunk_ids:
                v0 = starts[ci]
                v1 = min(v, v0 + chunk_vocab)
                w = weight[v0:v1].float()
                c = torch.addmm(lse_c, hs, w.t(), beta=-1)  # log p = s - lse
                if b_c is None:
                    dz = c.exp_().mul_(a_c)
                else:
                    dz = torch.exp(c).mul_(c.mul_(b_c).add_(a_c))
                hit = (tgt >= v0) & (tgt < v1)
                idx = (tgt - v0).clamp(0, v1 - v0 - 1).unsqueeze(1)
                dz.scatter_add_(1, idx, torch.where(hit, gl_c, 0.0).unsqueeze(1))
                if need_dhidden:
                    dh_parts[wi, n0:n1].addmm_(dz, w)
                if need_dweight:
                    dweight[v0:v1].addmm_(dz.t(), h)

    _run(work, workers)
    dhidden = dh_parts.sum(0).to(hidden.dtype) if need_dhidden else None
    if need_dweight:
        dweight = dweight.to(weight.dtype)
    return dhidden, dweight
