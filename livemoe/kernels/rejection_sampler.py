"""Rejection sampling of speculative drafts (forward only): which drafts the target keeps, and the token it adds.

Layout (the verifier's logits rows): sequence b owns rows cu_rows[b] .. cu_rows[b+1]-1, one per draft and the last
for the bonus token. Per row r: target_probs[r] (p, softmax of the filtered logits, fp32), draft_token_ids[r] (the
draft that row verifies; the bonus row's entry is ignored), draft_probs[r] (q; None: every draft a point mass, as
ngram's), uniforms[r] (U[0, 1)) and noise[r] (Exp(1) per vocabulary entry, for the exponential race).

The rule (the standard one; the emitted tokens are distributed as p):
  draft d at row r kept   iff  u_r < p_r(d) / q_r(d)   (q_r(d) = 1 for a point mass; q_r(d) <= 0: rejected)
  on a rejection          the token is argmax_v max(0, p_r - q_r)(v) / noise_r(v) (the exponential race over the
                          residual; for a point mass the residual is p_r with d zeroed), and the run ends; a residual
                          of all zeros (p == q up to rounding) keeps d
  every draft kept        the bonus token argmax_v p_last(v) / noise_last(v)
Given the same uniforms and noise the result is deterministic, and the Triton kernels compute it with the same fp32
operations as the reference (elementwise subtract, clamp, divide; first index on ties): equal, not close.

Out: tokens [B, max rows] int64 (-1 past each sequence's emitted tokens) and num_emitted [B] int32 (kept drafts +
1). The Triton kernels serve CUDA tensors (livemoe.engine.decoder.spec.verify uses them there); elsewhere the
reference runs.
"""
import torch
import triton
import triton.language as tl

BLOCK_V = 1024  # vocabulary entries per iteration of the residual race


def _check(target_probs, draft_token_ids, draft_probs, cu_rows, uniforms, noise) -> None:
    R, V = target_probs.shape
    assert target_probs.dtype == torch.float32 and noise.shape == (R, V) and noise.dtype == torch.float32
    assert draft_token_ids.shape == (R,) and uniforms.shape == (R,) and uniforms.dtype == torch.float32
    assert draft_probs is None or (draft_probs.shape == (R, V) and draft_probs.dtype == torch.float32)
    assert cu_rows.dim() == 1 and cu_rows.numel() >= 2


def rejection_sample_reference(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                               draft_probs: torch.Tensor | None, cu_rows: torch.Tensor, uniforms: torch.Tensor,
                               noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule in plain PyTorch, one row at a time (see the module doc)."""
    _check(target_probs, draft_token_ids, draft_probs, cu_rows, uniforms, noise)
    bounds = cu_rows.tolist()
    B = len(bounds) - 1
    width = max(hi - lo for lo, hi in zip(bounds, bounds[1:])) if B else 0
    tokens = torch.full((B, width), -1, dtype=torch.long)
    num_emitted = torch.zeros(B, dtype=torch.int32)
    for b in range(B):
        lo, hi = bounds[b], bounds[b + 1]
        n = 0
        for r in range(lo, hi - 1):
            d = int(draft_token_ids[r])
            p = target_probs[r]
            if draft_probs is None:
                q_d = torch.ones((), dtype=torch.float32)
                residual = p.clone()
                residual[d] = 0.0
            else:
                q_d = draft_probs[r, d]
                residual = (p - draft_probs[r]).clamp_min(0.0)
            kept = bool(q_d > 0) and bool(uniforms[r] < p[d] / q_d)
            score = residual / noise[r]
            token = d if kept or float(score.max()) <= 0.0 else int(score.argmax())
            tokens[b, n] = token
            n += 1
            if token != d:
                break
        else:
            tokens[b, n] = int((target_probs[hi - 1] / noise[hi - 1]).argmax())
            n += 1
        num_emitted[b] = n
    return tokens.to(target_probs.device), num_emitted.to(target_probs.device)


@triton.jit
def residual_race_kernel(P, Q, Noise, Draft_ids, Is_bonus, Recovered, V, stride_p, stride_q, stride_n,
                          HAS_Q: tl.constexpr, BLOCK_V: tl.constexpr):
    """Per row: argmax over the vocabulary of residual / noise (the bonus row: p / noise); the draft itself where
    the residual is all zeros."""
    row = tl.program_id(0).to(tl.int64)
    d = tl.load(Draft_ids + row)
    bonus = tl.load(Is_bonus + row) != 0
    draft_row = tl.load(Is_bonus + row) == 0
    best_val = -1.0
    best_idx = 0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        p = tl.load(P + row * stride_p + offs, mask=mask, other=0.0)
        if HAS_Q:
            q = tl.load(Q + row * stride_q + offs, mask=mask, other=0.0)
            r = tl.maximum(p - q, 0.0)
        else:
            r = tl.where(offs == d, 0.0, p)
        r = tl.where(bonus, p, r)
        e = tl.load(Noise + row * stride_n + offs, mask=mask, other=1.0)
        score = tl.where(mask, tl.math.div_rn(r, e), -1.0)  # IEEE division, as torch's (not div.full)
        val, idx = tl.max(score, axis=0, return_indices=True, return_indices_tie_break_left=True)
        take = val > best_val  # strict: an earlier block keeps a tie (torch.argmax: the first index)
        best_idx = tl.where(take, start + idx, best_idx)
        best_val = tl.where(take, val, best_val)
    out = tl.where((best_val <= 0.0) & draft_row, d, best_idx)
    tl.store(Recovered + row, out.to(tl.int64))


@triton.jit
def accept_kernel(P, Q, Draft_ids, Uniforms, Recovered, Cu_rows, Tokens, Num_emitted, stride_p, stride_q,
                   stride_t, HAS_Q: tl.constexpr):
    """Per sequence: walks its drafts in order, writes the kept ones, the first replacement or the bonus token."""
    b = tl.program_id(0)
    lo = tl.load(Cu_rows + b).to(tl.int64)
    hi = tl.load(Cu_rows + b + 1).to(tl.int64)
    alive = lo < hi
    n = 0
    for r in range(lo, hi - 1):
        d = tl.load(Draft_ids + r)
        p_d = tl.load(P + r * stride_p + d)
        u = tl.load(Uniforms + r)
        if HAS_Q:
            q_d = tl.load(Q + r * stride_q + d)
            kept = (q_d > 0.0) & (u < tl.math.div_rn(p_d, tl.where(q_d > 0.0, q_d, 1.0)))
        else:
            kept = u < p_d
        rec = tl.load(Recovered + r)
        token = tl.where(kept, d, rec)
        tl.store(Tokens + b * stride_t + n, token, mask=alive)
        n += alive.to(tl.int32)
        alive = alive & (token == d)
    bonus = tl.load(Recovered + hi - 1, mask=alive, other=-1)
    tl.store(Tokens + b * stride_t + n, bonus, mask=alive)
    n += alive.to(tl.int32)
    tl.store(Num_emitted + b, n)


def rejection_sample_triton(target_probs: torch.Tensor, draft_token_ids: torch.Tensor,
                            draft_probs: torch.Tensor | None, cu_rows: torch.Tensor, uniforms: torch.Tensor,
                            noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule in two launches: the residual race of every row at once, then one program per sequence."""
    _check(target_probs, draft_token_ids, draft_probs, cu_rows, uniforms, noise)
    R, V = target_probs.shape
    B = cu_rows.numel() - 1
    device = target_probs.device
    lengths = cu_rows[1:] - cu_rows[:-1]
    width = int(lengths.max()) if B else 0
    is_bonus = torch.zeros(R, dtype=torch.int8, device=device)
    is_bonus[(cu_rows[1:] - 1).long()[lengths > 0]] = 1
    p = target_probs.contiguous()
    q = p if draft_probs is None else draft_probs.contiguous()
    e = noise.contiguous()
    drafts = draft_token_ids.to(torch.int64).contiguous()
    recovered = torch.empty(R, dtype=torch.int64, device=device)
    tokens = torch.full((B, max(width, 1)), -1, dtype=torch.int64, device=device)
    num_emitted = torch.zeros(B, dtype=torch.int32, device=device)
    if R:
        residual_race_kernel[(R,)](p, q, e, drafts, is_bonus, recovered, V, p.stride(0), q.stride(0), e.stride(0),
                                    HAS_Q=draft_probs is not None, BLOCK_V=min(BLOCK_V, triton.next_power_of_2(V)))
    if B:
        accept_kernel[(B,)](p, q, drafts, uniforms.contiguous(), recovered, cu_rows.to(torch.int32).contiguous(),
                             tokens, num_emitted, p.stride(0), q.stride(0), tokens.stride(0),
                             HAS_Q=draft_probs is not None)
    return tokens[:, :width], num_emitted


def rejection_sample(target_probs: torch.Tensor, draft_token_ids: torch.Tensor, draft_probs: torch.Tensor | None,
                     cu_rows: torch.Tensor, uniforms: torch.Tensor,
                     noise: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [B, max rows] -1-padded, num_emitted [B]): the Triton kernels on CUDA, the reference elsewhere."""
    if target_probs.is_cuda:
        return rejection_sample_triton(target_probs, draft_token_ids, draft_probs, cu_rows, uniforms, noise)
    return rejection_sample_reference(target_probs, draft_token_ids, draft_probs, cu_rows, uniforms, noise)
