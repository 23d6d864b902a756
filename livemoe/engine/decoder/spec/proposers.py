"""Proposers: what drafts the tokens a step verifies. One interface, so the methods are interchangeable:

  propose(seqs, limits) -> per sequence (draft token ids, their draft distribution [len, V] or None)

None means a point mass on each draft token (a deterministic proposer: ngram), so verification accepts draft t
with probability p(t). A proposer may return fewer drafts than its limit, or none.

An MTP or EAGLE head would be one more Proposer: it needs the target's last hidden state of each sequence (the
runner would keep the hidden rows of the sampling positions) and its own small KV cache for its layer, and it
drafts with its own distribution like draft_model does. Not implemented.
"""
from abc import ABC, abstractmethod
from collections import deque

import numpy as np
import torch

from livemoe.engine.decoder.sequence import Sequence


class Proposer(ABC):
    @abstractmethod
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """For each sequence about to decode (its last token not yet computed), at most limits[i] draft tokens
        that would follow it, and their draft distribution (None: point masses)."""


class NgramProposer(Proposer):
    """Prompt lookup (vLLM's "ngram"): the longest suffix of the sequence's tokens, of prompt_lookup_max down to
    prompt_lookup_min tokens, that also occurs earlier in its prompt or output; the tokens that followed its latest
    earlier occurrence are the drafts. Copying from the prompt (RAG answers) is where it pays.

    With recent_outputs > 0 it also looks in the outputs of the engine's last recent_outputs finished sequences
    (each with the last CONTEXT_TOKENS of its prompt, so an answer's first tokens have something to follow), and
    takes a match there when it is longer than the sequence's own: answers that share a template draft from each
    other (SuffixDecoding's cross-request idea, arXiv 2411.04975, with prompt lookup's latest-occurrence rule)."""

    CONTEXT_TOKENS = 8

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int, recent_outputs: int = 0):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        self.recent: deque[np.ndarray] = deque(maxlen=recent_outputs)  # each ends with a -1 separator
        self._history: np.ndarray | None = None  # the recent outputs concatenated (rebuilt after a change)

    def propose(self, seqs, limits):
        return [(self.lookup(seq.token_ids, k), None) for seq, k in zip(seqs, limits)]

    def finished(self, seq: Sequence) -> None:
        """Keeps a finished sequence's output (and the end of its prompt) for later lookups."""
        if self.recent.maxlen and seq.num_output_tokens:
            start = max(0, seq.num_prompt_tokens - self.CONTEXT_TOKENS)
            self.recent.append(np.asarray(seq.token_ids[start:] + [-1], dtype=np.int64))
            self._history = None

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        L = len(token_ids)
        if k <= 0 or L <= self.min_n:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        n, end = self._longest(arr, L - 1, arr)  # an earlier occurrence: never the suffix itself
        if self.recent:
            if self._history is None:
                self._history = np.concatenate(self.recent)
            hist = self._history
            n_h, end_h = self._longest(hist, len(hist), arr)
            if n_h > n:
                follow = hist[end_h + 1:end_h + 1 + k]
                stop = np.flatnonzero(follow < 0)  # an output's end
                if not stop.size or stop[0]:  # (a match that ends an output has nothing to follow: the own one then)
                    return follow[:stop[0] if stop.size else len(follow)].tolist()
        if not n:
            return []
        return token_ids[end + 1:end + 1 + k]  # what followed the latest occurrence of the longest suffix found

    def _longest(self, hay: np.ndarray, hay_len: int, tokens: np.ndarray) -> tuple[int, int]:
        """(n, end): the longest n in [min_n, max_n] whose last n tokens of `tokens` occur in hay[:hay_len], and
        where the latest such occurrence ends; (0, -1) where none does. One pass over hay for the last token, then
        each longer n only filters the survivors."""
        ends = np.flatnonzero(hay[:hay_len] == tokens[-1])
        best, n = (0, -1), 1
        top = min(self.max_n, len(tokens))
        while ends.size:
            if n >= self.min_n:
                best = (n, int(ends[-1]))
            if n == top:
                break
            n += 1
            ends = ends[ends >= n - 1]
            ends = ends[hay[ends - (n - 1)] == tokens[-n]]
        return best
