"""SpeculativeConfig: `speculative_config={"method": "ngram", "num_speculative_tokens": 4, ...}` on the engine and
`--speculative-config JSON` on the server, with vLLM's key names. Validated here, in one place."""
import json
from dataclasses import dataclass, fields

from livemoe.engine.checks import check_positive_ints
from livemoe.engine.errors import EngineConfigError

METHODS = ("ngram", "draft_model")


@dataclass(kw_only=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int  # k: drafts per sequence per step (at most)
    # ngram (prompt lookup): the longest suffix of the sequence, between these lengths, that occurred before it
    # proposes the tokens that followed that occurrence
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # ngram: also look in the outputs of the engine's last this many finished sequences (0: off; not a vLLM key)
    lookup_recent_outputs: int = 0
    model: str | None = None  # draft_model: a checkpoint with the target's tokenizer and vocabulary
    # speculation is skipped for a step with more decoding sequences than this (verifying k+1 tokens per sequence
    # stops paying once the batch makes the step compute-bound); counted in stats()
    disable_by_batch_size: int = 4

    def __post_init__(self):
        def fail(msg):
            raise EngineConfigError(f"speculative_config: {msg}")

        if self.method not in METHODS:
            fail(f"method must be one of {METHODS}, got {self.method!r}")
        check_positive_ints(self, ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
                                   "disable_by_batch_size"), fail)
        if self.prompt_lookup_min > self.prompt_lookup_max:
            fail(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= prompt_lookup_max "
                 f"({self.prompt_lookup_max})")
        if self.method == "draft_model" and not isinstance(self.model, str):
            fail("method 'draft_model' needs 'model': the draft checkpoint's directory")
        if self.method == "ngram" and self.model is not None:
            fail("'model' is for method 'draft_model'; ngram drafts from the sequence itself")
        if type(self.lookup_recent_outputs) is not int or self.lookup_recent_outputs < 0:
            fail(f"lookup_recent_outputs must be an int >= 0, got {self.lookup_recent_outputs!r}")
        if self.method != "ngram" and self.lookup_recent_outputs:
            fail("'lookup_recent_outputs' is for method 'ngram'")

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig | None":
        """A SpeculativeConfig, a dict of its keys, a JSON object string (the server's flag), or None."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise EngineConfigError(f"speculative_config: not valid JSON ({e})") from None
        if not isinstance(value, dict):
            raise EngineConfigError(f"speculative_config must be a JSON object / dict, got {type(value).__name__}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise EngineConfigError(f"speculative_config: unknown key(s) {unknown}; known: {sorted(known)}")
        missing = [k for k in ("method", "num_speculative_tokens") if k not in value]
        if missing:
            raise EngineConfigError(f"speculative_config: missing {missing}")
        return cls(**value)
