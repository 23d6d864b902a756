"""Proposers: what drafts the tokens a step verifies. One interface, so the methods are interchangeable:

  propose(seqs, limits) -> per sequence (draft token ids, their draft distribution [len, V] or None)

None means a point mass on each draft token (a deterministic proposer: ngram), so verification accepts draft t
with probability p(t). A proposer may return fewer drafts than its limit, or none.

An MTP or EAGLE head would be one more Proposer: it needs the target's last hidden state of each sequence (the
runner would keep the hidden rows of the sampling positions) and its own small KV cache for its layer, and it
drafts with its own distribution like draft_model does. Not implemented.
"""
from abc import ABC, abstractmethod

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
    earlier occurrence are the drafts. Copying from the prompt (RAG answers) is where it pays."""

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int):
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, seqs, limits):
        return [(self.lookup(seq.token_ids, k), None) for seq, k in zip(seqs, limits)]

    def lookup(self, token_ids: list[int], k: int) -> list[int]:
        L = len(token_ids)
        if k <= 0 or L <= self.min_n:
            return []
        arr = np.asarray(token_ids, dtype=np.int64)
        # ends[i]: where an earlier occurrence of the suffix's last n tokens ends (never the suffix itself), for
        # n = 1, 2, ...: one pass over the sequence for the last token, then each step only filters the survivors
        ends = np.flatnonzero(arr[:L - 1] == arr[L - 1])
        found = None
        for n in range(2, min(self.max_n, L - 1) + 1):
            if n - 1 >= self.min_n and ends.size:
                found = ends
            ends = ends[ends >= n - 1]
            ends = ends[arr[ends - (n - 1)] == arr[L - n]]
            if not ends.size:
                break
        else:
            if min(self.max_n, L - 1) >= self.min_n and ends.size:
                found = ends
        if found is None or not found.size:
            return []
        start = int(found[-1]) + 1  # the latest occurrence of the longest suffix found
        return token_ids[start:start + k]
