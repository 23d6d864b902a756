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
                if q_d <= 0.0 or sampler.uniform(device, seq.generator) < min(1.0, p_d / q_d):
                    token, accepted = d, True  # (q_d == 0: a draft its own distribution could not draw)
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
