"""Sampler: logits of the sampling rows -> next tokens (+ logprobs), per-row parameters in one batch.

Filters (see livemoe.engine.sampling.params for the order) become -inf logits; sampling is the exponential race
argmax(p / E), E ~ Exp(1), with E drawn from the row's own generator when the request has a seed, so a
seeded request gets the same tokens whatever else is in the batch.

Before temperature, the rows that ask for it get their logits processed (livemoe.engine.sampling.logits_processors: the
grammar mask, min_tokens, logit_bias, penalties); "raw" logprobs stay those of the unprocessed logits.
"""
from dataclasses import dataclass

import numpy as np
import torch

from livemoe.engine.sampling.logits_processors import process_logits
from livemoe.engine.sampling.params import SamplingParams
from livemoe.kernels import batch_invariant
from livemoe.kernels.batch_invariant import ops as exact_ops


@dataclass(slots=True)
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict[int, float] | None]  # per row: {sampled token: lp, top-1: lp, ...} or None


def filter_logits(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """logits [B, V] (already divided by temperature); top_k [B] (<= 0: off), top_p [B], min_p [B].
    Returns logits with the tokens outside each row's kept set at -inf."""
    V = logits.shape[-1]
    out = logits
    need_sort = bool(((top_k > 0) & (top_k < V)).any() or (top_p < 1.0).any())
    if need_sort:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(V, device=logits.device)
        k = torch.where(top_k > 0, top_k, V).clamp(max=V)
        remove = rank[None, :] >= k[:, None]
        sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
        probs = sorted_logits.softmax(-1)
        before = probs.cumsum(-1) - probs  # probability of the tokens ranked above
        remove = remove | (before >= top_p[:, None])  # the token that crosses top_p has before < top_p
        out = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
    if bool((min_p > 0).any()):
        # p_i >= min_p * p_max  <=>  logit_i >= logit_max + log(min_p): no softmax needed
        threshold = out.max(-1, keepdim=True).values + torch.log(min_p.clamp(min=1e-30))[:, None]
        out = out.masked_fill(out < threshold, float("-inf"))
    return out


def argmax_only(params: list[SamplingParams]) -> bool:
    """Whether sampling these rows is their logits' argmax and nothing else (greedy, no logprobs, no processing)."""
    return all(p.greedy and p.logprobs is None and not p.processes_logits for p in params)


def argmax_tokens(logits: torch.Tensor) -> tuple[list[int], float | None]:
    """logits [B, V] -> (each row's argmax, the largest logit of the batch where it comes free, else None): the one
    greedy path, for the Sampler and for the engine's greedy steps. The tokens are torch's argmax (a row's first
    maximum; a row holding NaN picks a NaN). CPU fp32 logits are read through numpy: a step at batch 1 pays ~1-2 us
    per numpy call against several per torch op, and the max of the picked logits comes with it; it propagates NaN,
    so it is non-finite exactly when logits.amax() is (what the engine's non-finite check reads)."""
    if logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.requires_grad:
        return logits.argmax(-1).tolist(), None
    a = logits.numpy()
    if a.shape[0] == 1:
        i = int(a[0].argmax())
        return [i], float(a[0, i])
    idx = a.argmax(-1)
    return idx.tolist(), float(a[np.arange(a.shape[0]), idx].max())


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids=()):
        self.seed = seed
        self.eos_token_ids = set(eos_token_ids)  # what min_tokens bans
        self._generators: dict[torch.device, torch.Generator] = {}  # for requests without a seed

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._generators:
            self._generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._generators[device]

    @torch.no_grad()
    def __call__(self, logits: torch.Tensor, params: list[SamplingParams],
                 generators: list[torch.Generator | None], seqs=None) -> SampleResult:
        """logits [B, V]; params and generators (None: the shared one) per row; seqs (livemoe.engine.decoder.sequence's,
        per row: their tokens and grammar state) are needed only when a row's params process logits."""
        B, V = logits.shape
        assert len(params) == B == len(generators)
        if argmax_only(params):  # nothing else asked
            return SampleResult(argmax_tokens(logits)[0], [None] * B)
        d = self.distributions(logits, params, seqs)
        sample_rows = [i for i in range(B) if not params[i].greedy]
        every_row = len(sample_rows) == B  # a rollout batch: skip the row indexing
        tokens = None if every_row else d.processed.argmax(-1)
        if sample_rows:
            gens = [generators[i] for i in sample_rows]
            if every_row:
                tokens = self.draw(d.filtered.softmax(-1), gens)
            else:
                assert tokens is not None  # the greedy rows' argmax
                tokens[sample_rows] = self.draw(d.filtered[sample_rows].softmax(-1), gens)
        assert tokens is not None  # every row sampled, or the argmax
        return SampleResult(tokens.tolist(), self.logprobs(d, params, tokens))

    def distributions(self, logits: torch.Tensor, params: list[SamplingParams], seqs=None) -> "Distributions":
        """The rows' logits processed (logits processors), then scaled by temperature and filtered: what sampling
        draws from (softmax of `filtered`), and the raw scaled logits the "raw" logprobs come from."""
        B = logits.shape[0]
        raw_logits, any_processing = logits, any(p.processes_logits for p in params)
        if any_processing:
            assert seqs is not None and len(seqs) == B, "logits processing needs the rows' sequences"
            logits = process_logits(logits.float(), params, seqs, self.eos_token_ids)
        logits = logits.float()
        device = logits.device
        # greedy rows (temperature below MIN_TEMPERATURE) are divided by 1: their raw logprobs are log_softmax(logits)
        divisor = torch.tensor([1.0 if p.greedy else p.temperature for p in params], device=device)[:, None]
        scaled = exact_ops.scale_logits(logits, divisor)  # the trainer's division too (exact mode)
        raw_scaled = exact_ops.scale_logits(raw_logits, divisor) if any_processing else scaled
        any_filter = any(p.top_k > 0 or p.top_p < 1 or p.min_p > 0 for p in params)
        if any_filter:
            filtered = filter_logits(
                scaled, torch.tensor([0 if p.greedy else p.top_k for p in params], device=device),
                torch.tensor([1.0 if p.greedy else p.top_p for p in params], device=device),
                torch.tensor([0.0 if p.greedy else p.min_p for p in params], device=device))
        else:
            filtered = scaled
        return Distributions(logits, filtered, raw_scaled, any_filter or any_processing)

    def exponential_noise(self, rows: int, V: int, device, generators: list[torch.Generator | None]) -> torch.Tensor:
        """[rows, V] Exp(1) draws for the exponential race, each row from its own generator (None: the shared one)."""
        noise = torch.empty(rows, V, device=device)
        shared = [j for j, g in enumerate(generators) if g is None]
        if shared:
            noise[shared] = torch.empty(len(shared), V, device=device).exponential_(
                generator=self._shared_generator(device))
        noise_rows = noise.unbind(0)
        for j, g in enumerate(generators):
            if g is not None:
                noise_rows[j].exponential_(generator=g)
        return noise

    def draw(self, probs: torch.Tensor, generators: list[torch.Generator | None]) -> torch.Tensor:
        """A token per row of probs [R, V] (unnormalised), by the exponential race argmax(p / E), E from each row's
        generator (None: the shared one): the one sampling rule of the engine (decoding, verification, drafts)."""
        R, V = probs.shape
        return (probs / self.exponential_noise(R, V, probs.device, generators)).argmax(-1)

    def uniform(self, device, generator: torch.Generator | None) -> float:
        """One U[0, 1) draw from the row's generator (None: the shared one)."""
        return float(self.uniforms(1, device, generator)[0])

    def uniforms(self, n: int, device, generator: torch.Generator | None) -> torch.Tensor:
        """[n] U[0, 1) draws from the row's generator (None: the shared one), left on the device."""
        g = generator if generator is not None else self._shared_generator(device)
        return torch.rand(n, device=device, generator=g)

    @staticmethod
    def logprobs(d: "Distributions", params: list[SamplingParams], tokens: torch.Tensor) -> list[dict[int, float] | None]:
        """Per row that asks: {chosen token: logprob, top-1: lp, ...} under its logprobs_mode; None elsewhere."""
        B, V = d.filtered.shape
        out: list[dict[int, float] | None] = [None] * B
        rows = [i for i in range(B) if params[i].logprobs is not None]
        if not rows:
            return out
        token_ids = tokens.tolist()
        pick = (lambda t: t) if len(rows) == B else (lambda t: t[rows])  # a rollout batch asks on every row
        raw = log_softmax(pick(d.raw_scaled))
        dist = raw
        if d.changed:
            processed = log_softmax(pick(d.filtered))
            use_raw = torch.tensor([params[i].logprobs_mode == "raw" for i in rows], device=raw.device)
            dist = torch.where(use_raw[:, None], raw, processed)
        # the chosen tokens' logprobs in one gather (a rollout asks for them at every step)
        chosen = dist.gather(1, pick(tokens)[:, None])[:, 0].tolist()
        for j, i in enumerate(rows):
            entry = {token_ids[i]: chosen[j]}
            k = params[i].logprobs
            assert k is not None  # a row that asks
            n = min(k, V)
            if n:
                top_lp, top_ids = dist[j].topk(n)
                for t, lp in zip(top_ids.tolist(), top_lp.tolist()):
                    entry.setdefault(t, lp)
            out[i] = entry
        return out


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """Log-probs of fp32 logits [B, V]; in the exact mode the batch-invariant kernel's (the trainer's bits)."""
    return exact_ops.log_softmax(logits) if batch_invariant.enabled() else logits.log_softmax(-1)


@dataclass(slots=True)
class Distributions:
    """Sampler.distributions' rows: `processed` logits (greedy takes their argmax), `filtered` (scaled by
    temperature and filtered: sampling draws from their softmax), `raw_scaled` (raw logprobs), and whether
    processing or a filter changed anything (else processed logprobs are the raw ones)."""
    processed: torch.Tensor
    filtered: torch.Tensor
    raw_scaled: torch.Tensor
    changed: bool

    def row(self, i: int) -> "Distributions":
        return Distributions(self.processed[i:i + 1], self.filtered[i:i + 1], self.raw_scaled[i:i + 1], self.changed)

    def rows(self, n: int) -> "Distributions":
        """The first n rows."""
        return Distributions(self.processed[:n], self.filtered[:n], self.raw_scaled[:n], self.changed)
