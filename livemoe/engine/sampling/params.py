"""SamplingParams: how one request is decoded. Validated at construction (RequestError, a ValueError).

Filtering order (what `sampler.py` does, and what "processed" logprobs see):
  logits / temperature -> top_k (keep the k largest) -> top_p (the smallest set, largest first, whose
  probability under the top-k-renormalised distribution reaches top_p; the token that crosses top_p is
  kept) -> min_p (keep tokens with p >= min_p * p_max).
temperature < MIN_TEMPERATURE (0 included) is greedy (argmax of the raw logits; filters are then
irrelevant): dividing by a smaller one overflows the logits (NaN, or a row of inf that samples at random).

logprobs_mode:
  "raw"       log_softmax(logits / temperature) before any filtering (log_softmax(logits) when greedy):
              what an RL trainer recomputes from the same weights, so old_logprobs match.
  "processed" log_softmax of the filtered logits (tokens outside the kept set get -inf).
"""
import sys
from dataclasses import dataclass, field
from typing import TypeGuard

from livemoe.engine.errors import RequestError
from livemoe.engine.sampling.structured import StructuredOutput

LOGPROBS_MODES = ("raw", "processed")
MIN_TEMPERATURE = 1e-5  # below it: greedy (vLLM's threshold too); logits / 1e-5 stay far from fp32's max
INT64_MAX = 2**63 - 1  # what the engine's tensors and torch.Generator seeds hold
PENALTY_RANGE = 2.0  # OpenAI's bounds for presence/frequency penalties
LOGIT_BIAS_RANGE = 100.0


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    temperature: float = 1.0
    top_k: int = -1  # -1 or 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None  # per-request generator: same tokens whatever else is in the batch
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    stop_token_ids: list[int] = field(default_factory=list)  # included in token_ids, not in text
    ignore_eos: bool = False
    n: int = 1
    logprobs: int | None = None  # None: none; 0: the sampled token's; N: also the top-N
    logprobs_mode: str = "raw"
    # None: none; N >= 0: each prompt token's logprob (and the top-N) given the tokens before it, from the
    # model's own distribution (no temperature or filters, as vLLM's); the first token has none
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    # logits processing before temperature (livemoe.engine.sampling.logits_processors; vLLM's definitions)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1: off
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    min_tokens: int = 0  # EOS and stop_token_ids banned (and stop strings not checked) before this many
    structured: StructuredOutput | None = None  # livemoe.engine.sampling.structured: JSON schema, regex, choice, grammar
    # each completion's routed experts, [tokens, MoE layers, k] (livemoe.engine.routed_experts; refused on a dense model)
    return_routed_experts: bool = False
    # each completion's per-token weight_version: the label of the weights that drew the token (the trainer's policy
    # version, given with each weight update; None for weights loaded without one): partial rollouts for RL
    return_weight_versions: bool = False
    processes_logits: bool = field(init=False, default=False, repr=False, compare=False)  # any of the above

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)

        def fail(msg):
            raise RequestError(f"SamplingParams: {msg}")

        if not _is_number(self.temperature) or not 0 <= self.temperature <= sys.float_info.max:
            fail(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        # every integer must fit the int64 tensors and generator seeds it ends up in (seed + i for sample i)
        ints = {"top_k": self.top_k, "max_tokens": self.max_tokens, "n": self.n, "logprobs": self.logprobs,
                "prompt_logprobs": self.prompt_logprobs,
                "stop_token_ids": max((t for t in self.stop_token_ids if _is_int(t)), default=0)}
        if _is_int(self.seed) and _is_int(self.n):
            ints["seed + n - 1"] = self.seed + max(self.n, 1) - 1
        too_big = [f"{name} must be at most 2**63 - 1, got {v}" for name, v in ints.items()
                   if _is_int(v) and v > INT64_MAX]
        if too_big:
            fail("; ".join(too_big))
        if not _is_int(self.top_k) or self.top_k < -1:
            fail(f"top_k must be an integer >= 1, or -1/0 to disable, got {self.top_k!r}")
        if not _is_number(self.top_p) or not 0.0 < self.top_p <= 1.0:
            fail(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            fail(f"min_p must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            fail(f"seed must be a non-negative integer or None, got {self.seed!r}")
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            fail(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not all(isinstance(s, str) and s for s in self.stop):
            fail(f"stop must be a list of non-empty strings, got {self.stop!r}")
        if not all(_is_int(t) and t >= 0 for t in self.stop_token_ids):
            fail(f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}")
        if not _is_int(self.n) or self.n < 1:
            fail(f"n must be an integer >= 1, got {self.n!r}")
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < 0):
            fail(f"logprobs must be None or an integer >= 0, got {self.logprobs!r}")
        if self.prompt_logprobs is not None and (not _is_int(self.prompt_logprobs) or self.prompt_logprobs < 0):
            fail(f"prompt_logprobs must be None or an integer >= 0, got {self.prompt_logprobs!r}")
        if not isinstance(self.return_routed_experts, bool):
            fail(f"return_routed_experts must be a bool, got {self.return_routed_experts!r}")
        if not isinstance(self.return_weight_versions, bool):
            fail(f"return_weight_versions must be a bool, got {self.return_weight_versions!r}")
        if self.logprobs_mode not in LOGPROBS_MODES:
            fail(f"logprobs_mode must be one of {LOGPROBS_MODES}, got {self.logprobs_mode!r}")
        validate_logits_processing(self, fail)
        self.processes_logits = needs_processing(self)  # read at every step: computed once

    @property
    def greedy(self) -> bool:
        return self.temperature < MIN_TEMPERATURE


def _is_int(x) -> TypeGuard[int]:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x  # x == x rejects NaN


def validate_logits_processing(p: SamplingParams, fail) -> None:
    """The range checks of what changes the logits (livemoe.engine.sampling.logits_processors applies them)."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not _is_number(v) or not -PENALTY_RANGE <= v <= PENALTY_RANGE:
            fail(f"{name} must be in [-{PENALTY_RANGE}, {PENALTY_RANGE}], got {v!r}")
    if not _is_number(p.repetition_penalty) or not p.repetition_penalty > 0:
        fail(f"repetition_penalty must be a number > 0 (1 = off), got {p.repetition_penalty!r}")
    if p.logit_bias is not None:
        if not isinstance(p.logit_bias, dict):
            fail(f"logit_bias must be a dict of token id -> bias, got {type(p.logit_bias).__name__}")
        bad = {k: v for k, v in p.logit_bias.items()
               if not _is_int(k) or k < 0 or not _is_number(v) or not -LOGIT_BIAS_RANGE <= v <= LOGIT_BIAS_RANGE}
        if bad:
            fail(f"logit_bias maps token ids >= 0 to biases in [-{LOGIT_BIAS_RANGE}, {LOGIT_BIAS_RANGE}]; "
                 f"bad entries: {dict(list(bad.items())[:5])}")
    if not _is_int(p.min_tokens) or not 0 <= p.min_tokens <= p.max_tokens:
        fail(f"min_tokens must be an integer in [0, max_tokens={p.max_tokens}], got {p.min_tokens!r}")
    if p.structured is not None:
        if not isinstance(p.structured, StructuredOutput):
            fail(f"structured must be a livemoe.engine.sampling.structured.StructuredOutput, got {type(p.structured).__name__}")
        if p.ignore_eos:
            fail("structured output cannot be combined with ignore_eos: the grammar ends the text with EOS")
        if p.min_tokens:  # a grammar that completes earlier would leave no token allowed
            fail("structured output cannot be combined with min_tokens: the grammar decides where the output ends")


def needs_processing(p: SamplingParams) -> bool:
    return (p.structured is not None or p.min_tokens > 0 or bool(p.logit_bias) or p.repetition_penalty != 1.0
            or p.presence_penalty != 0.0 or p.frequency_penalty != 0.0)


def check_vocab(p: SamplingParams, vocab_size: int) -> None:
    """The token ids a request names must be in the vocabulary (checked when it is added)."""
    if p.logit_bias:
        bad = [t for t in p.logit_bias if t >= vocab_size]
        if bad:
            raise RequestError(f"logit_bias token ids out of the vocabulary [0, {vocab_size}): {bad[:5]}")
