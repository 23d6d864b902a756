"""What the decoder returns: RequestOutput (one per request, in input order from generate), holding one
CompletionOutput per sample (n of them) and the request's metrics."""
from dataclasses import dataclass, field
from typing import Any


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop" (EOS, stop id or string), "length", "abort"; None while running
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per token {sampled: lp, top-1: lp, ...}
    tool_calls: list[dict] | None = None  # LLM.chat with tools: [{"name", "arguments": JSON text}] parsed from text
    # return_routed_experts: numpy [tokens, MoE layers, k] (livemoe.engine.routed_experts), set once finished
    routed_experts: Any = None
    weight_versions: list | None = None  # return_weight_versions: per token, the label of the weights that drew it

    @property
    def token_logprobs(self) -> list[float] | None:
        """The sampled tokens' logprobs (the RL trainer's old_logprobs in raw mode)."""
        if self.logprobs is None:
            return None
        return [lp[t] for t, lp in zip(self.token_ids, self.logprobs)]


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finish_time: float | None = None
    ttft: float | None = None  # seconds from arrival to the first token
    tpot: float | None = None  # mean seconds per output token after the first
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0  # all n completions
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache
    num_preemptions: int = 0
    decode_flops: int = 0  # livemoe.engine.model.flops.decode_flops over the output tokens (2 x active x tokens)
    # speculative decoding (all n completions): drafts verified, drafts kept, and verifications
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_spec_steps: int = 0

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verification (kept drafts + the target's own token); None without speculation."""
        n = self.num_spec_steps
        return (self.num_accepted_tokens + n) / n if n else None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics = field(repr=False, default=None)
    # SamplingParams.prompt_logprobs: per prompt token {token: lp, top-1: lp, ...}, None for the first (vLLM's)
    prompt_logprobs: list[dict[int, float] | None] | None = field(repr=False, default=None)

    # the first completion's fields, for the common n == 1 case
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def logprobs(self):
        return self.outputs[0].logprobs

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def stop_reason(self) -> int | str | None:
        return self.outputs[0].stop_reason
