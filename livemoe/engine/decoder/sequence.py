"""Sequence: one stream of tokens being decoded (a request with n > 1 holds n of them).

`num_computed_tokens` counts the tokens whose K/V are in the cache; a step computes the next
`num_new_tokens` of them (a prefill chunk, or the last token for a decode) and samples only when the
chunk reaches the end of the sequence.
"""
import time
from enum import Enum, auto
from itertools import count

import torch

from livemoe.engine.multimodal.layout import MediaLayout
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.sampling.structured import GrammarState
from livemoe.engine.text.detokenizer import IncrementalDetokenizer


class SequenceStatus(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, token_ids: list[int], params: SamplingParams, request_id: str = "", index: int = 0,
                 seed: int | None = None, arrival_time: float | None = None, media: MediaLayout | None = None):
        assert token_ids, "a sequence needs at least one prompt token"
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.index = index  # which of the request's n completions
        self.params = params
        self.token_ids = list(token_ids)
        self.num_prompt_tokens = len(token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[int] = []  # chained hashes of the full blocks registered so far
        self.status = SequenceStatus.WAITING
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.seed = seed
        self.generator: torch.Generator | None = None  # made on the sampling device at first use
        self.logprobs: list[dict] = []  # per output token: {token_id: logprob, ...} (sampled first)
        self.weight_versions: list = []  # return_weight_versions: per output token, the weights' label that drew it
        self.num_preemptions = 0
        self.num_cached_prompt_tokens = 0  # prefix-cache hit at first scheduling
        self.uncached_prefill = False  # computes every prompt token, no prefix-cache hit (prompt logprobs)
        self.text = ""  # detokenized output, kept only when stop strings need it
        self.detokenizer: IncrementalDetokenizer | None = None  # of the output: stop strings, in-flight text
        self.grammar: GrammarState | None = None  # when the request's output is constrained
        # speculative decoding (livemoe.engine.decoder.spec): drafts sit at the end of token_ids, uncomputed, from the
        # proposal to the verification of one step, and never outlive it
        self.num_draft_tokens = 0
        self.draft_probs: torch.Tensor | None = None  # [num_draft_tokens, V], None: point masses
        self.num_spec_steps = 0  # verifications
        self.num_drafted_tokens = 0
        self.num_accepted_tokens = 0
        self.spec_misses = 0  # verifications in a row that kept no draft
        self.num_draft_computed = 0  # draft_model: tokens whose K/V the draft model has written (spec/draft_model.py)
        self.spec_skip_steps = 0  # decode steps to go without drafting (backoff after misses)
        self.routed_experts = None  # return_routed_experts: read from the runner as the sequence finishes
        # media over placeholder tokens (a Qwen3-Omni-MoE thinker): their items, rotary positions and cache keys
        self.media = media
        # what a token's position adds to its index past the prompt (multimodal rotary; 0 for text)
        self.rope_delta = 0 if media is None else media.rope_delta
        # metrics
        self.arrival_time = time.perf_counter() if arrival_time is None else arrival_time
        self.first_token_time: float | None = None
        self.last_token_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_uncomputed_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def num_blocks(self, block_size: int, num_tokens: int | None = None) -> int:
        n = len(self) if num_tokens is None else num_tokens
        return (n + block_size - 1) // block_size

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        """Block i's prefix-cache key: its tokens, with media placeholders standing for their item's content."""
        return self.cache_keys(i * block_size, (i + 1) * block_size)

    def cache_keys(self, start: int, end: int) -> list[int]:
        keys = self.token_ids[start:end]
        if self.media is not None:
            self.media.overlay_keys(keys, start)
        return keys

    def append_token(self, token_id: int, now: float | None = None) -> None:
        now = time.perf_counter() if now is None else now
        if self.first_token_time is None:
            self.first_token_time = now
        self.last_token_time = now
        self.token_ids.append(token_id)

    def add_drafts(self, drafts: list[int], probs: torch.Tensor | None = None) -> None:
        assert not self.num_draft_tokens and self.num_computed_tokens == len(self.token_ids) - 1, self
        self.token_ids += drafts
        self.num_draft_tokens, self.draft_probs = len(drafts), probs

    def drop_drafts(self, keep: int = 0) -> None:
        """Removes the drafts past the first `keep` (they were not scheduled, or the sequence was preempted)."""
        if self.num_draft_tokens > keep:
            del self.token_ids[len(self.token_ids) - self.num_draft_tokens + keep:]
            self.num_draft_tokens = keep
            self.num_draft_computed = min(self.num_draft_computed, len(self.token_ids))
            if self.draft_probs is not None:
                self.draft_probs = self.draft_probs[:keep] if keep else None

    def take_drafts(self) -> tuple[list[int], torch.Tensor | None]:
        """After the verification forward: the drafts and their distribution, removed from token_ids and from
        the computed count (verify.py puts back the accepted ones)."""
        k = self.num_draft_tokens
        drafts, probs = self.token_ids[len(self.token_ids) - k:], self.draft_probs
        del self.token_ids[len(self.token_ids) - k:]
        self.num_computed_tokens = min(self.num_computed_tokens, len(self.token_ids))
        self.num_draft_tokens, self.draft_probs = 0, None
        return drafts, probs

    def __repr__(self) -> str:
        return (f"Sequence(id={self.seq_id}, req={self.request_id!r}, len={len(self)}, "
                f"computed={self.num_computed_tokens}, status={self.status.name})")


class Request:
    """One request in flight: its prompt and params and its n sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
                 seqs: list[Sequence]):
        self.request_id, self.prompt, self.prompt_ids, self.params, self.seqs = request_id, prompt, prompt_ids, params, seqs
        self.arrival_time = seqs[0].arrival_time
        self.finish_time: float | None = None
        self.prompt_logprobs: list[dict[int, float] | None] | None = None  # when asked, once the prefill is done

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)
