"""The OpenAI request bodies the server accepts (pydantic), and their mapping to SamplingParams.

Field types are checked by pydantic and ranges by SamplingParams (one place for the rules): either
failure is a 400 with an OpenAI-style error body. Unknown fields are ignored, as OpenAI's own clients
send some we do not use; fields we cannot honour (penalties, logit_bias, echo, suffix, best_of) are
refused rather than silently dropped. Extensions in the body: `top_k`, `min_p`, `ignore_eos`,
`return_token_ids` (each choice, streamed or not, also carries its token ids).

Types are strict: `"5"` or `true` is no integer, and NaN, Infinity or 1e999 no number. The server's
limits (ServerConfig) are checked by the app. On chat, `special_tokens_in_content` (default false)
reads special tokens written in a message as tokens rather than text (engine.prompts).
"""
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.sampling import RequestError, SamplingParams

STRICT = ConfigDict(strict=True, allow_inf_nan=False)  # no coercion ("5" -> 5, true -> 1), finite floats


class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", **STRICT)

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    user: str | None = None

    def _refuse_unsupported(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name) not in (None, 0, 0.0):
                raise RequestError(f"{name} is not supported by this server (only 0)")
        if self.logit_bias:
            raise RequestError("logit_bias is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream: true")

    def _params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        self._refuse_unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        opt = {k: v for k, v in dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                     min_p=self.min_p).items() if v is not None}
        return SamplingParams(max_tokens=max_tokens, n=self.n, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
                              logprobs=logprobs, **opt)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    def prompts(self) -> list:
        """The prompts, each a string or a list of token ids."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise RequestError("prompt is empty")
        return list(p)

    def sampling_params(self, room: int) -> SamplingParams:
        """room: the tokens left in the context after the longest prompt (max_tokens defaults to 16, or less
        when less is left)."""
        if self.echo:
            raise RequestError("echo is not supported by this server")
        if self.suffix:
            raise RequestError("suffix is not supported by this server")
        if self.best_of not in (None, self.n):
            raise RequestError("best_of is not supported by this server (only best_of == n)")
        return self._params(min(16, room) if self.max_tokens is None else self.max_tokens, self.logprobs)


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", **STRICT)

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        return {"role": self.role, "content": content or ""}


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    special_tokens_in_content: bool = False

    def sampling_params(self, room: int) -> SamplingParams:
        """room: the tokens left in the context after the prompt (the default max_tokens)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(room if max_tokens is None else max_tokens, logprobs)


def error_body(message: str, code: str | None = None, param: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
