"""The OpenAI request bodies the server accepts (pydantic), and their mapping to SamplingParams.

Field types are checked by pydantic and ranges by SamplingParams (one place for the rules): either
failure is a 400 with an OpenAI-style error body. Every field is honoured or refused: an unknown field
is a 400 naming it, and so is a known one used in a way we cannot serve (prompt logprobs on a stream, suffix,
best_of != n; each model's REFUSED_WHEN lists them for the docs' field table, field_table.py).
The only fields accepted without an effect are NO_EFFECT_FIELDS, which by nature mean nothing to a
local server. Extensions in the body: `top_k`, `min_p`, `ignore_eos`, `return_token_ids` (each choice,
streamed or not, also carries its token ids), `return_routed_experts` (each choice's last chunk, or the choice,
carries `routed_experts`: base64 + shape + dtype, livemoe.engine.routed_experts), `return_weight_versions` (each
choice, or chunk, carries `weight_versions`: per token the `weight_version` label of the weights that drew it, set
by the weight-update routes: partial rollouts), `repetition_penalty`, `min_tokens`,
and vLLM's `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (livemoe.engine.sampling.structured),
`prompt_logprobs` and `stream_options.continuous_usage_stats`. Older clients' spellings are read as what they
mean: the `developer` role as `system`, `functions` / `function_call` as tools, `response_format.schema` with
type json_object as a JSON schema.

Types are strict: `"5"` or `true` is no integer, and NaN, Infinity or 1e999 no number. The server's
limits (ServerConfig) are checked by the app. On chat, `special_tokens_in_content` (default false)
reads special tokens written in a message as tokens rather than text (livemoe.engine.text.prompts).
"""
import re
from typing import Annotated, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, model_validator

from livemoe.engine.errors import RequestError
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.sampling.structured import StructuredOutput
from livemoe.engine.text.tool_parser import template_tool_calls

# OpenAI fields that have no effect on a local server by nature: an end-user id for abuse monitoring,
# tags and storage for OpenAI's dashboard, a billing tier. Accepted (type-checked) and not used.
NO_EFFECT_FIELDS = ("user", "metadata", "store", "service_tier")
TOKEN_ID_KEY = re.compile(r"[0-9]+")  # a logit_bias key (re.ASCII not needed: [0-9] is ASCII)


class StrictModel(BaseModel):
    # an unknown field is a 400 naming it, never ignored; no coercion ("5" -> 5, true -> 1); finite floats
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class JsonSchemaFormat(StrictModel):
    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced (by the grammar), strict or not


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None
    # older clients (instructor's JSON_SCHEMA mode) send {"type": "json_object", "schema": {...}}
    schema_: dict | None = Field(default=None, alias="schema")

    def spec(self) -> tuple[str, dict] | None:
        """(the field that asked, the StructuredOutput arguments), or None for text."""
        if self.json_schema is not None and self.type != "json_schema":
            raise RequestError("response_format: json_schema is only allowed with type json_schema")
        if self.schema_ is not None:
            if self.type == "json_object":
                return "response_format.schema", dict(json=self.schema_)
            raise RequestError(f"response_format.schema is only read with type json_object; with type {self.type} "
                               "send the schema as response_format.json_schema.schema")
        if self.type == "json_object":
            return "response_format", dict(json_object=True)
        if self.type == "json_schema":
            if self.json_schema is None or self.json_schema.schema_ is None:
                raise RequestError("response_format: type json_schema needs json_schema.schema")
            return "response_format.json_schema.schema", dict(json=self.json_schema.schema_)
        return None


class StreamOptions(StrictModel):
    include_usage: bool = False  # a last chunk with the request's usage
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class _Common(StrictModel):
    # for the docs' field table (field_table.py): the fields that are not OpenAI's, and whose they are; the fields
    # refused in some uses, and when (the checks below raise the 400s)
    EXTENSIONS: ClassVar[dict[str, str]] = {
        **{k: "vLLM" for k in ("top_k", "min_p", "ignore_eos", "return_token_ids", "repetition_penalty", "min_tokens",
                               "guided_json", "guided_regex", "guided_choice", "guided_grammar", "prompt_logprobs",
                               "stream_options.continuous_usage_stats", "return_routed_experts")},
        "return_weight_versions": "livemoe", "response_format.schema": "older clients (instructor)"}
    REFUSED_WHEN: ClassVar[dict[str, str]] = {
        "stream_options": "without stream: true", "prompt_logprobs": "with stream: true",
        "return_routed_experts": "on a dense model",
        "response_format.schema": "with a type other than json_object"}
    NO_EFFECT: ClassVar[tuple[str, ...]] = NO_EFFECT_FIELDS

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
    prompt_logprobs: int | None = None  # vLLM's: each prompt token's logprob and the top-N
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a JSON key) -> bias
    min_tokens: int | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    return_routed_experts: bool = False  # each choice's routed_experts (livemoe.engine.routed_experts)
    return_weight_versions: bool = False  # each choice's weight_versions: per token, its weights' weight_version
    response_format: ResponseFormat | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # NO_EFFECT_FIELDS
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None

    def _refuse_unsupported(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise RequestError("stream_options is only allowed with stream: true")
        if self.stream and self.prompt_logprobs is not None:  # as vLLM
            raise RequestError("prompt_logprobs is not available with stream: true")

    def constraint(self) -> tuple[StructuredOutput, str] | None:
        """The output constraint the body asks for, and the field that asked (named by a compile error)."""
        asked = []
        found = self.response_format.spec() if self.response_format is not None else None
        if found is not None:
            asked.append(found)
        for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                           ("guided_grammar", "grammar")):
            if getattr(self, name) is not None:
                asked.append((name, {kind: getattr(self, name)}))
        if len(asked) > 1:
            raise RequestError(f"only one output constraint per request; got {', '.join(n for n, _ in asked)}")
        if not asked:
            return None
        name, spec = asked[0]
        try:
            return StructuredOutput(**spec), name
        except RequestError as e:
            raise RequestError(f"{name}: {str(e).removeprefix('StructuredOutput: ')}") from None

    def _logit_bias(self) -> dict[int, float] | None:
        if self.logit_bias is None:
            return None
        # int() also takes " 5", "5_0" and other scripts' digits ("٣"): a token id is ASCII digits only
        bad = [k for k in self.logit_bias if not TOKEN_ID_KEY.fullmatch(k)]
        if bad:
            raise RequestError(f"logit_bias: keys must be token ids (ASCII digits), got {bad[:5]}")
        return {int(k): v for k, v in self.logit_bias.items()}

    def _params(self, max_tokens: int, logprobs: int | None, structured: StructuredOutput | None = None,
                prompt_logprobs: int | None = None) -> SamplingParams:
        self._refuse_unsupported()
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        opt = {k: v for k, v in dict(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                     min_p=self.min_p, presence_penalty=self.presence_penalty,
                                     frequency_penalty=self.frequency_penalty,
                                     repetition_penalty=self.repetition_penalty,
                                     min_tokens=self.min_tokens).items() if v is not None}
        return SamplingParams(max_tokens=max_tokens, n=self.n, seed=self.seed, stop=stop, ignore_eos=self.ignore_eos,
                              logprobs=logprobs, logit_bias=self._logit_bias(), structured=structured,
                              prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
                              return_routed_experts=self.return_routed_experts,
                              return_weight_versions=self.return_weight_versions, **opt)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_Common):
    REFUSED_WHEN: ClassVar[dict[str, str]] = {**_Common.REFUSED_WHEN, "echo": "with logprobs and stream: true",
                                              "suffix": "non-empty", "best_of": "other than n"}

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
        prompt_logprobs = None
        if self.echo and self.logprobs is not None:  # the prompt tokens' logprobs lead each choice's
            if self.stream:
                raise RequestError("echo with logprobs is not available with stream: true")
            prompt_logprobs = max(self.logprobs, self.prompt_logprobs or 0)
        if self.suffix:
            raise RequestError("suffix is not supported by this server")
        if self.best_of not in (None, self.n):
            raise RequestError("best_of is not supported by this server (only best_of == n)")
        found = self.constraint()
        return self._params(min(16, room) if self.max_tokens is None else self.max_tokens, self.logprobs,
                            found[0] if found else None, prompt_logprobs)


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


# media content parts (a Qwen3-Omni-MoE thinker; livemoe.engine.multimodal.chat), as OpenAI and vLLM spell them
class InputAudio(StrictModel):
    data: str  # base64 WAV (16 kHz)
    format: str = "wav"


class InputAudioPart(StrictModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class MediaUrl(StrictModel):
    url: str  # a data URL, or a path under the server's --allowed-local-media-path
    detail: str | None = None  # OpenAI's image detail: accepted, the image's own size decides (max_image_pixels)


class AudioUrlPart(StrictModel):
    type: Literal["audio_url"]
    audio_url: MediaUrl


class ImageUrlPart(StrictModel):
    type: Literal["image_url"]
    image_url: MediaUrl


class VideoUrlPart(StrictModel):
    type: Literal["video_url"]
    video_url: MediaUrl


ContentPart = Annotated[TextPart | InputAudioPart | AudioUrlPart | ImageUrlPart | VideoUrlPart,
                        Field(discriminator="type")]


class FunctionCall(StrictModel):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


# OpenAI's newer name for system, and the legacy functions API's result role (a tool result named by function)
ROLE_ALIASES = {"developer": "system", "function": "tool"}


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None  # given to the chat template with the message
    tool_calls: list[ToolCall] | None = None  # an assistant's earlier calls
    function_call: FunctionCall | None = None  # the same in the legacy functions API (one call)
    tool_call_id: str | None = None  # a tool result's call

    def as_template_input(self) -> dict:
        content = self.content
        if isinstance(content, list):  # text parts joined; with media, the parts (livemoe.engine.multimodal.chat)
            text_only = all(isinstance(part, TextPart) for part in content)
            content = "".join(p.text for p in content) if text_only else [p.model_dump() for p in content]
        message = {"role": ROLE_ALIASES.get(self.role, self.role), "content": content or ""}
        if self.name is not None:
            message["name"] = self.name
        calls = [c.model_dump() for c in self.tool_calls or []]
        if self.function_call is not None:
            if calls:
                raise RequestError("a message has both tool_calls and function_call; send one")
            calls = [{"id": None, "type": "function", "function": self.function_call.model_dump()}]
        if calls:
            message["tool_calls"] = template_tool_calls(calls)
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        return message


class FunctionDef(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None  # arguments always match the parameters when the grammar enforces a call


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Common):
    EXTENSIONS: ClassVar[dict[str, str]] = {**_Common.EXTENSIONS, "special_tokens_in_content": "livemoe"}
    REFUSED_WHEN: ClassVar[dict[str, str]] = {
        **_Common.REFUSED_WHEN, "top_logprobs": "without logprobs: true",
        "parallel_tool_calls": "false with tool_choice auto", "functions": "with tools or tool_choice",
        "function_call": "without functions"}

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    special_tokens_in_content: bool = False
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # true: allowed (required/named make one call, auto what the model writes)
    # the legacy functions API: read as tools / tool_choice; the answer then has message.function_call
    functions: list[FunctionDef] | None = None
    function_call: Literal["none", "auto"] | NamedFunction | None = None
    _legacy_functions: bool = PrivateAttr(default=False)

    @model_validator(mode="after")
    def _functions_as_tools(self):
        if self.functions is None:
            if self.function_call is not None:
                raise ValueError("function_call needs functions")
            return self
        if self.tools is not None or self.tool_choice is not None:
            raise ValueError("functions and function_call are the legacy spelling of tools and tool_choice: send "
                             "one or the other")
        self.tools = [Tool(type="function", function=f) for f in self.functions]
        fc = self.function_call
        self.tool_choice = NamedToolChoice(type="function", function=fc) if isinstance(fc, NamedFunction) else fc
        self._legacy_functions = True
        return self

    @property
    def legacy_functions(self) -> bool:
        """The request used `functions`: the answer's call goes in message.function_call (one call)."""
        return self._legacy_functions

    def tool_mode(self) -> str:
        """none (no tools in the prompt, no parsing), auto (parsed if the model calls), required or named
        (the grammar makes the output one call)."""
        choice = self.tool_choice
        if not self.tools:
            if choice not in (None, "none"):
                raise RequestError("tool_choice needs tools")
            return "none"
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in {t.function.name for t in self.tools}:
                raise RequestError(f"tool_choice names the function {choice.function.name!r}, which is not in tools")
            return "named"
        if (choice or "auto") == "auto" and self.parallel_tool_calls is False:
            raise RequestError("parallel_tool_calls: false needs tool_choice 'required' or a named function (the "
                               "grammar then makes exactly one call); with 'auto' the model may write several")
        return choice or "auto"

    def tool_functions(self) -> list[dict]:
        return [t.function.model_dump(exclude_none=True) for t in self.tools or []]

    def constraint(self) -> tuple[StructuredOutput, str] | None:
        """response_format / guided_*, or the grammar of a required or named tool call."""
        found = super().constraint()
        mode = self.tool_mode()
        if mode in ("required", "named"):
            if found:
                raise RequestError(f"{found[1]} cannot be combined with tool_choice {mode!r} (which constrains "
                                   f"the output to a tool call)")
            functions = [{"name": t.function.name, "parameters": t.function.parameters} for t in self.tools]
            if mode == "named":
                functions = [f for f in functions if f["name"] == self.tool_choice.function.name]
            return StructuredOutput(tool_call=functions), "tools"
        return found

    def sampling_params(self, room: int) -> SamplingParams:
        """room: the tokens left in the context after the prompt (the default max_tokens)."""
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs needs logprobs: true")
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        found = self.constraint()
        return self._params(room if max_tokens is None else max_tokens, logprobs, found[0] if found else None)


def error_body(message: str, code: str | None = None, param: str | None = None,
               kind: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
