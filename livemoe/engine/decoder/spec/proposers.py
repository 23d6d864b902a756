"""Proposers: what drafts the tokens a step verifies. One interface, so the methods are interchangeable:

  propose(seqs, limits) -> per sequence (draft token ids, their draft distribution [len, V] or None)

None means a point mass on each draft token (a deterministic proposer: ngram), so verification accepts draft t
with probability p(t). A proposer may return fewer drafts than its limit, or none.

An MTP or EAGLE head would be one more Proposer: it needs the target's last hidden state of each sequence (the
runner would keep the hidden rows of the sampling positions) and its own small KV cache for its layer, and it
drafts with its own distribution like draft_model does. Not implemented.
"""
from abc import ABC, abstractmethod
from array import array
from collections import deque

import torch

from livemoe.engine.decoder.sequence import Sequence


class Proposer(ABC):
    @abstractmethod
    def propose(self, seqs: list[Sequence], limits: list[int]) -> list[tuple[list[int], torch.Tensor | None]]:
        """For each sequence about to decode (its last token not yet computed), at most limits[i] draft tokens
        that would follow it, and their draft distribution (None: point masses)."""


_ITEM = 8  # bytes of a token in the searched buffers (array "q")


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
        self.recent: deque[list[int]] = deque(maxlen=recent_outputs)  # each ends with a -1 separator
        self._history: array | None = None  # the recent outputs concatenated (rebuilt after a change)
        self._history_bytes = b""

    def propose(self, seqs, limits):
        return [(self.lookup(seq.token_ids, k), None) for seq, k in zip(seqs, limits)]

    def finished(self, seq: Sequence) -> None:
        """Keeps a finished sequence's output (and the end of its prompt) for later lookups."""
        if self.recent.maxlen and seq.num_output_tokens:
            start = max(0, seq.num_prompt_tokens - self.CONTEXT_TOKENS)
            self.recent.append(seq.token_ids[start:] + [-1])
            self._history = None

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        L = len(token_ids)
        if k <= 0 or L <= self.min_n:
            return []
        # int64 tokens as bytes: bytes.rfind finds an n-gram's latest occurrence in C (numpy's filters cost more
        # at these lengths)
        own = array("q", token_ids).tobytes()
        tail = own[-min(self.max_n, L) * _ITEM:]
        n, end = self._longest(own, L - 1, tail)  # an earlier occurrence: never the suffix itself
        if self.recent:
            if self._history is None:
                self._history = array("q", [t for out in self.recent for t in out])
                self._history_bytes = self._history.tobytes()
            hist = self._history
            n_h, end_h = self._longest(self._history_bytes, len(hist), tail)
            if n_h > n:
                follow = hist[end_h + 1:end_h + 1 + k].tolist()
                cut = follow.index(-1) if -1 in follow else len(follow)  # an output's end
                if cut:  # (a match that ends an output has nothing to follow: the own one then)
                    return follow[:cut]
        if not n:
            return []
        return token_ids[end + 1:end + 1 + k]  # what followed the latest occurrence of the longest suffix found

    def _longest(self, hay: bytes, hay_len: int, tail: bytes) -> tuple[int, int]:
        """(n, end): the longest n in [min_n, max_n] whose last n tokens of `tail` occur in the first hay_len tokens
        of `hay`, and where the latest such occurrence ends; (0, -1) where none does. hay and tail: int64 tokens as
        bytes (a byte match must start on a token's boundary)."""
        limit = hay_len * _ITEM
        for n in range(len(tail) // _ITEM, self.min_n - 1, -1):
            needle = tail[-n * _ITEM:]
            stop = limit
            while (i := hay.rfind(needle, 0, stop)) >= 0:
                if i % _ITEM == 0:
                    return n, i // _ITEM + n - 1
                stop = i + len(needle) - 1  # a match inside tokens: look further back
        return 0, -1
