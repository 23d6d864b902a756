"""Verification: which of a sequence's drafts the target keeps, and the token it adds.

For position j (0..k) the target's distribution p_j is the sampler's own: the logits processed against the
sequence as it stands (the tokens accepted so far are appended before position j+1 is looked at, so penalties,
min_tokens and a grammar see exactly what decoding without speculation would), then scaled and filtered.

  greedy   a draft is kept while it equals argmax p_j; the first mismatch yields the argmax instead.
  sampled, a draft model's drafts (d drawn from q_j): d is kept with probability min(1, p_j(d) / q_j(d)); on a
           rejection the token is drawn from normalise(max(0, p_j - q_j)) and the run ends (the standard rule: the
           emitted tokens are distributed as p).
  sampled, ngram's drafts (q_j a point mass on d): the token is drawn from p_j exactly as decoding without
           speculation draws it (the exponential race, with the same draws from the sequence's generator), and d is
           kept if the draw is d. That is the same rule (kept with probability p_j(d); otherwise a token of p_j other
           than d), and it makes a seeded request's tokens those decoding without speculation gives, whatever the
           batch and whether a step speculates.
  all kept one more token drawn from p_k (the "bonus" token).

On CUDA, a draft model's sampled drafts whose distributions do not depend on the tokens kept before (no logits
processing) are verified in one call of livemoe.kernels.rejection_sampler (the Triton kernels: every row's residual
race at once, then the walk over the drafts), the uniforms and the races' noise drawn up front from the sequence's
generator: the same rule, other draws than the row-by-row path (a seed reproduces a request's tokens on one device).
A draft the draft model could not draw (q(d) = 0) is rejected on either path.

Random draws come from the sequence's generator when it has a seed, so seeded requests are reproducible.
"""
from collections.abc import Iterator

import torch

from livemoe.engine.decoder.sequence import Sequence
from livemoe.engine.sampling.sampler import Sampler


def verified_tokens(sampler: Sampler, seq: Sequence, logits: torch.Tensor, drafts: list[int],
                    q: torch.Tensor | None) -> Iterator[tuple[int, dict | None, bool]]:
    """Yields (token, its logprobs entry or None, whether it is an accepted draft) in order; the caller appends
    each to seq before asking for the next, and stops asking when seq finishes. logits [len(drafts) + 1, V]."""
    params = seq.params
    if params.greedy and params.logprobs is None and not params.processes_logits:  # all positions at once
        target = logits.argmax(-1).tolist()
        for j, d in enumerate(drafts):
            if target[j] != d:
                yield target[j], None, False
                return
            yield d, None, True
        yield target[len(drafts)], None, False
        return
    device = logits.device
    if q is not None and not params.greedy and not params.processes_logits and use_rejection_kernel(logits):
        yield from _verified_on_device(sampler, seq, logits, drafts, q)
        return
    # without logits processing the distributions do not depend on the tokens kept before: all rows at once
    every = None if params.processes_logits else sampler.distributions(logits, [params] * len(logits))
    for j in range(len(drafts) + 1):
        dist = every.row(j) if every is not None else sampler.distributions(logits[j:j + 1], [params], [seq])
        accepted = False
        if params.greedy:
            token = int(dist.processed[0].argmax())
            accepted = j < len(drafts) and token == drafts[j]
        elif q is None:  # a point-mass draft: draw the token decoding without speculation would, keep d if it is d
            token = int(sampler.draw(dist.filtered.softmax(-1), [seq.generator])[0])
            accepted = j < len(drafts) and token == drafts[j]
        else:
            p = dist.filtered[0].softmax(-1)
            if j < len(drafts):
                d = drafts[j]
                q_d, p_d = float(q[j, d]), float(p[d])
                if q_d > 0.0 and sampler.uniform(device, seq.generator) < min(1.0, p_d / q_d):
                    token, accepted = d, True
                else:
                    residual = (p - q[j].to(p)).clamp_min(0.0)
                    if float(residual.sum()) > 0:
                        token = int(sampler.draw(residual[None], [seq.generator])[0])  # never d: its residual is 0
                    else:  # p == q up to rounding: nothing to draw instead
                        token, accepted = d, True
            else:
                token = int(sampler.draw(p[None], [seq.generator])[0])
        yield token, Sampler.logprobs(dist, [params], torch.tensor([token], device=device))[0], accepted
        if not accepted:
            return


def use_rejection_kernel(logits: torch.Tensor) -> bool:
    """Whether a draft model's sampled drafts go through the rejection sampler's kernels (CUDA: one call, not a loop
    of small ops per draft); tests force it on the CPU, where the call runs the sampler's reference."""
    return logits.is_cuda


def _verified_on_device(sampler: Sampler, seq: Sequence, logits: torch.Tensor, drafts: list[int],
                        q: torch.Tensor) -> Iterator[tuple[int, dict | None, bool]]:
    """verified_tokens for a draft model's sampled drafts, the rule applied to every row in one call."""
    from livemoe.kernels.rejection_sampler import rejection_sample  # Triton: imported where it runs

    params, device = seq.params, logits.device
    k, V = len(drafts), logits.shape[-1]
    every = sampler.distributions(logits, [params] * (k + 1))
    p = every.filtered.softmax(-1)
    q_rows = torch.cat([q.to(p), torch.zeros(1, V, dtype=p.dtype, device=device)])  # the bonus row has no draft
    uniforms = sampler.uniforms(k + 1, device, seq.generator)
    noise = sampler.exponential_noise(k + 1, V, device, [seq.generator] * (k + 1))
    draft_ids = torch.tensor(drafts + [0], dtype=torch.long, device=device)
    cu_rows = torch.tensor([0, k + 1], dtype=torch.int32, device=device)
    tokens, num_emitted = rejection_sample(p, draft_ids, q_rows, cu_rows, uniforms, noise)
    n = int(num_emitted[0])
    emitted = tokens[0, :n]
    lps = Sampler.logprobs(every.rows(n), [params] * n, emitted)
    for j, (token, lp) in enumerate(zip(emitted.tolist(), lps)):
        yield token, lp, j < n - 1  # all but the last are kept drafts; the last is a replacement or the bonus
