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
        self.recent: deque[bytes] = deque(maxlen=recent_outputs)  # int64 tokens as bytes, each ending with a -1
        self._history: bytes | None = None  # the recent outputs concatenated (rebuilt after a change)

    def propose(self, seqs, limits):
        return [(self.lookup(seq.token_ids, k), None) for seq, k in zip(seqs, limits)]

    def finished(self, seq: Sequence) -> None:
        """Keeps a finished sequence's output (and the end of its prompt) for later lookups."""
        if self.recent.maxlen and seq.num_output_tokens:
            start = max(0, seq.num_prompt_tokens - self.CONTEXT_TOKENS)
            self.recent.append(array("q", seq.token_ids[start:] + [-1]).tobytes())
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
                self._history = b"".join(self.recent)
            hist = self._history
            n_h, end_h = self._longest(hist, len(hist) // _ITEM, tail)
            if n_h > n:
                follow = array("q", hist[(end_h + 1) * _ITEM:(end_h + 1 + k) * _ITEM]).tolist()
                cut = follow.index(-1) if -1 in follow else len(follow)  # an output's end
                if cut:  # (a match that ends an output has nothing to follow: the own one then)
                    return follow[:cut]
        if not n:
            return []
        return token_ids[end + 1:end + 1 + k]  # what followed the latest occurrence of the longest suffix found

    def _longest(self, hay: bytes, hay_len: int, tail: bytes) -> tuple[int, int]:
        """(n, end): the longest n in [min_n, max_n] whose last n tokens of `tail` occur in the first hay_len tokens
        of `hay`, and where the latest such occurrence ends; (0, -1) where none does. hay and tail: int64 tokens as
        bytes. Shortest first: where the n-token suffix does not occur no longer one does, and a search that fails
        reads the whole hay (one that finds reads from the end)."""
        best, limit = (0, -1), hay_len * _ITEM
        for n in range(self.min_n, len(tail) // _ITEM + 1):
            needle = tail[-n * _ITEM:]
            stop = limit
            while (i := hay.rfind(needle, 0, stop)) >= 0 and i % _ITEM:
                stop = i + len(needle) - 1  # a match inside tokens: look further back
            if i < 0:
                break
            best = (n, i // _ITEM + n - 1)
        return best
