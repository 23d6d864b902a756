"""POST /v1/responses, OpenAI's Responses API, over the chat path: a request is read as the chat request it
means (`ResponsesRequest.as_chat`: `instructions` as the system turn, `input` items as messages, function tools,
`text.format` as response_format, `max_output_tokens` as max_tokens) and served by the same tokenizing, limits,
grammar and engine request as /v1/chat/completions; its output is shaped into output items (`reasoning` from the
server's --reasoning-parser, `message`, `function_call`) as one JSON Response or as the Responses stream's typed
events, which `client.responses.create(stream=True)` and `client.responses.stream` read.

Conversation state is not kept: `previous_response_id` (and `store: true`, `background: true`) are refused, so a
client sends the whole conversation in `input` (its earlier output items go back as they came; reasoning items
are not put back in the prompt, as Qwen3's template drops earlier turns' reasoning). Every other field is honoured
or refused by name. A response that runs out of `max_output_tokens` ends `incomplete`
(`incomplete_details.reason: max_output_tokens`; the stream's last event is then `response.incomplete`).
"""
import time
import uuid
from typing import ClassVar, Literal

import msgspec
from pydantic import Field, ValidationError

from livemoe.engine.errors import EngineError, RequestError
from livemoe.engine.server.protocol import ChatCompletionRequest, FunctionDef, StrictModel

# OpenAI fields with no effect on a local server by nature (as protocol.NO_EFFECT_FIELDS)
NO_EFFECT_FIELDS = ("user", "metadata", "service_tier")


class ContentPart(StrictModel):
    type: Literal["input_text", "output_text"]  # output_text: an earlier response's message sent back
    text: str
    annotations: list | None = None  # (an output_text's; nothing to use in a prompt)
    logprobs: list | None = None


class _IdentifiedItem(StrictModel):
    """The id and status every output item carries, accepted back when a client sends the items again."""
    id: str | None = None
    status: str | None = None


class InputMessage(_IdentifiedItem):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: str | list[ContentPart]


class FunctionCallItem(_IdentifiedItem):
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(_IdentifiedItem):
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ReasoningItem(_IdentifiedItem):
    type: Literal["reasoning"]
    summary: list = []
    content: list | None = None
    encrypted_content: str | None = None


class FunctionTool(FunctionDef):
    type: Literal["function"]


class NamedTool(StrictModel):
    type: Literal["function"]
    name: str


class TextFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, max_length=64)
    description: str | None = None
    schema_: dict | None = Field(default=None, alias="schema")
    strict: bool | None = None  # the schema is always enforced (by the grammar)


class TextConfig(StrictModel):
    format: TextFormat | None = None


class ResponsesRequest(StrictModel):
    EXTENSIONS: ClassVar[dict[str, str]] = {k: "vLLM" for k in ("top_k", "seed", "stop", "ignore_eos")}
    REFUSED_WHEN: ClassVar[dict[str, str]] = {
        "previous_response_id": "always (no state is kept)", "store": "true", "background": "true",
        "include": "non-empty", "truncation": "auto", "reasoning": "with any setting but null"}
    NO_EFFECT: ClassVar[tuple[str, ...]] = NO_EFFECT_FIELDS

    model: str
    input: str | list[InputMessage | FunctionCallItem | FunctionCallOutputItem | ReasoningItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    # refused unless off: no state is kept, reasoning effort is the model's own
    previous_response_id: str | None = None
    store: bool | None = None
    background: bool | None = None
    include: list[str] | None = None
    truncation: Literal["disabled", "auto"] | None = None
    reasoning: dict | None = None
    # extensions, as vLLM's (guidellm sends stop and ignore_eos)
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    ignore_eos: bool = False
    # NO_EFFECT_FIELDS
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None

    def refuse_unsupported(self) -> None:
        if self.previous_response_id is not None:
            raise RequestError("previous_response_id: this server keeps no conversation state; send the whole "
                               "conversation in input (earlier output items go back as they came)")
        for name, why in (("store", "responses are not kept"), ("background", "responses run in the foreground")):
            if getattr(self, name):
                raise RequestError(f"{name}: true is not supported ({why}); send false or leave it out")
        if self.include:
            raise RequestError(f"include: {self.include} is not supported by this server")
        if self.truncation == "auto":
            raise RequestError("truncation: auto is not supported (a prompt over the context is refused); send "
                               "disabled or leave it out")
        if self.reasoning is not None and any(v is not None for v in self.reasoning.values()):
            raise RequestError("reasoning: not supported (the model reasons as its chat template says; with "
                               "--reasoning-parser its reasoning comes back as a reasoning item)")

    def as_chat(self) -> ChatCompletionRequest:
        """The chat request this one means (validated as one: the same limits and checks)."""
        self.refuse_unsupported()
        body = {"model": self.model, "messages": self._messages(), "stream": self.stream,
                "max_tokens": self.max_output_tokens, "ignore_eos": self.ignore_eos}
        for name in ("temperature", "top_p", "top_k", "seed", "stop", "parallel_tool_calls", "user", "metadata",
                     "service_tier"):
            if getattr(self, name) is not None:
                body[name] = getattr(self, name)
        if self.tools is not None:
            body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                             for t in self.tools]
        choice = self.tool_choice
        if choice is not None:
            body["tool_choice"] = ({"type": "function", "function": {"name": choice.name}}
                                   if isinstance(choice, NamedTool) else choice)
        fmt = self.text.format if self.text is not None else None
        if fmt is not None:
            self._check_format(fmt)
        if choice == "required" or isinstance(choice, NamedTool):
            # a forced call leaves no text for the format to shape (instructor's RESPONSES_TOOLS sends both):
            # the chat request it means has the call's grammar alone
            fmt = None
        if fmt is not None and fmt.type == "json_schema":
            spec = {"name": fmt.name, "schema": fmt.schema_, "description": fmt.description, "strict": fmt.strict}
            body["response_format"] = {"type": "json_schema",
                                       "json_schema": {k: v for k, v in spec.items() if v is not None}}
        elif fmt is not None and fmt.type == "json_object":
            body["response_format"] = {"type": "json_object"}
        try:
            return ChatCompletionRequest.model_validate(body)
        except ValidationError as e:
            raise RequestError(f"invalid request: {e.errors()[0]['msg']}") from None

    @staticmethod
    def _check_format(fmt: TextFormat) -> None:
        if fmt.type == "json_schema" and (fmt.schema_ is None or fmt.name is None):
            raise RequestError("text.format: type json_schema needs name and schema")
        if fmt.type != "json_schema" and (fmt.schema_ is not None or fmt.name is not None):
            raise RequestError(f"text.format: name and schema are only read with type json_schema, not {fmt.type}")

    def _messages(self) -> list[dict]:
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        if isinstance(self.input, str):
            return messages + [{"role": "user", "content": self.input}]
        for item in self.input:
            if isinstance(item, InputMessage):
                content = item.content if isinstance(item.content, str) else "".join(p.text for p in item.content)
                messages.append({"role": item.role, "content": content})
            elif isinstance(item, FunctionCallItem):
                call = {"id": item.call_id, "type": "function",
                        "function": {"name": item.name, "arguments": item.arguments}}
                last = messages[-1] if messages else None
                if last is not None and last["role"] == "assistant":  # calls of one turn go in one message
                    last.setdefault("tool_calls", []).append(call)
                else:
                    messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif isinstance(item, FunctionCallOutputItem):
                messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.output})
        if not messages:
            raise RequestError("input has no message")
        return messages


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


_json = msgspec.json.Encoder()


class ResponseShape:
    """One engine request's deltas as a Response: `collect()` the JSON object, `events()` the typed stream. Both
    run the same item state machine (a stream and the JSON answer agree by construction)."""

    def __init__(self, run, body: ResponsesRequest, count_tokens):
        """run: the request's responses.Run (its deltas, usage and choice parser); count_tokens(text): the
        reasoning tokens' count for usage."""
        self.run, self.body, self.count_tokens = run, body, count_tokens
        self.id = _id("resp")
        self.created = int(time.time())
        self.items: list[dict] = []
        self.open: dict | None = None  # the item deltas go into
        self.sequence = 0
        self.finish_reason: str | None = None

    # -- the Response object --------------------------------------------------------------------

    def response(self, status: str) -> dict:
        b = self.body
        fmt = b.text.format.model_dump(by_alias=True, exclude_none=True) if b.text and b.text.format else None
        out = {"id": self.id, "object": "response", "created_at": self.created, "status": status,
               "model": self.run.server.model_name, "output": [dict(i) for i in self.items], "error": None,
               "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
               "instructions": b.instructions, "max_output_tokens": b.max_output_tokens,
               "temperature": b.temperature, "top_p": b.top_p, "parallel_tool_calls": b.parallel_tool_calls is not False,
               "tool_choice": (b.tool_choice.model_dump() if isinstance(b.tool_choice, NamedTool)
                               else b.tool_choice or "auto"),
               "tools": [t.model_dump(exclude_none=True) for t in b.tools or []],
               "text": {"format": fmt or {"type": "text"}}, "metadata": b.metadata or {}, "user": b.user,
               "previous_response_id": None, "reasoning": None, "store": False, "truncation": "disabled",
               "usage": None}
        if status in ("completed", "incomplete"):
            out["usage"] = self._usage()
        return out

    def _usage(self) -> dict:
        usage = self.run._usage()
        reasoning = "".join(c["text"] for i in self.items if i["type"] == "reasoning" for c in i["content"])
        return {"input_tokens": usage["prompt_tokens"],
                "input_tokens_details": {"cached_tokens": usage["prompt_tokens_details"]["cached_tokens"]},
                "output_tokens": usage["completion_tokens"],
                "output_tokens_details": {"reasoning_tokens": self.count_tokens(reasoning) if reasoning else 0},
                "total_tokens": usage["total_tokens"]}

    @property
    def status(self) -> str:
        return "incomplete" if self.finish_reason == "length" else "completed"

    # -- the item state machine -----------------------------------------------------------------

    def _event(self, kind: str, **fields) -> bytes:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return b"event: " + kind.encode() + b"\ndata: " + _json.encode(event) + b"\n\n"

    async def _run(self):
        """Every event, as the deltas come: the lifecycle events around the output items'."""
        yield self._event("response.created", response=self.response("in_progress"))
        yield self._event("response.in_progress", response=self.response("in_progress"))
        parser = self.run.parsers[0]
        async for _, d in self.run.deltas():
            last = d.finish_reason is not None
            fields = parser.feed(d.text, last=last)
            for e in self._text("reasoning", fields.get("reasoning_content", "")):
                yield e
            for e in self._text("message", fields.get("content", "")):
                yield e
            for call in fields.get("tool_calls", []):
                for e in self._call(call):
                    yield e
            if last:
                self.finish_reason = d.finish_reason
        for e in self._close():
            yield e
        kind = "response.completed" if self.status == "completed" else "response.incomplete"
        yield self._event(kind, response=self.response(self.status))

    def _text(self, kind: str, text: str):
        if not text:
            return
        if self.open is None or self.open["type"] != kind:
            yield from self._close()
            yield from self._add(kind)
        item, index = self.open, len(self.items) - 1
        item["content"][0]["text"] += text
        event = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra = {"logprobs": []} if kind == "message" else {}
        yield self._event(event, item_id=item["id"], output_index=index, content_index=0, delta=text, **extra)

    def _add(self, kind: str):
        if kind == "message":
            item = {"id": _id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        else:
            item = {"id": _id("rs"), "type": "reasoning", "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        self.items.append(item)
        self.open = item
        index = len(self.items) - 1
        yield self._event("response.output_item.added", output_index=index, item={**item, "content": []})
        item["content"].append(part)
        yield self._event("response.content_part.added", item_id=item["id"], output_index=index, content_index=0,
                          part=dict(part))

    def _close(self):
        item, self.open = self.open, None
        if item is None:
            return
        index = self.items.index(item)
        part = item["content"][0]
        if item["type"] == "message":
            yield self._event("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                              text=part["text"], logprobs=[])
        else:
            yield self._event("response.reasoning_text.done", item_id=item["id"], output_index=index,
                              content_index=0, text=part["text"])
        yield self._event("response.content_part.done", item_id=item["id"], output_index=index, content_index=0,
                          part=dict(part))
        item["status"] = "incomplete" if self.finish_reason == "length" else "completed"
        yield self._event("response.output_item.done", output_index=index, item=item)

    def _call(self, call: dict):
        yield from self._close()
        fn = call["function"]
        item = {"id": _id("fc"), "type": "function_call", "call_id": call["id"], "name": fn["name"], "arguments": "",
                "status": "in_progress"}
        self.items.append(item)
        index = len(self.items) - 1
        yield self._event("response.output_item.added", output_index=index, item=dict(item))
        item["arguments"] = fn["arguments"]
        yield self._event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                          delta=fn["arguments"])
        yield self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                          name=fn["name"], arguments=fn["arguments"])
        item["status"] = "completed"
        yield self._event("response.output_item.done", output_index=index, item=item)

    # -- the two answers ------------------------------------------------------------------------

    async def collect(self) -> dict:
        async for _ in self._run():
            pass
        return self.response(self.status)

    async def events(self):
        try:
            async for e in self._run():
                yield e
        except EngineError as e:
            yield self._event("error", code="internal_error", message=str(e), param=None)
