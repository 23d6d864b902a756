"""Tool calls in the Qwen3 / Hermes format: the model writes each call as

    <tool_call>
    {"name": "lookup", "arguments": {"id": 3}}
    </tool_call>

`ToolCallParser` turns output text, fed whole or as streamed deltas, into content (the text outside
the calls) and calls ({"name", "arguments": JSON text}); the non-streaming answer feeds the whole text
through the same parser, so a stream's deltas join to exactly the non-streaming result. A block whose
body is not a call (bad JSON, no name) stays in the content, as the model wrote it.
"""
import json
import uuid

from livemoe.engine.errors import RequestError
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.sampling.structured import TOOL_CALL_CLOSE, TOOL_CALL_OPEN, StructuredOutput
from livemoe.engine.text.reasoning import partial_suffix


def parse_call(body: str) -> dict | None:
    """{"name", "arguments": JSON text} from a block's body, or None if it is not a call."""
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as JSON text
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return {"name": call["name"], "arguments": json.dumps(args, ensure_ascii=False)}


class ToolCallParser:
    def __init__(self):
        self.buffer = ""  # text not yet given out: a possible opening marker, or a call's unfinished block
        self.in_call = False
        self.calls: list[dict] = []

    def feed(self, text: str) -> tuple[str, list[dict]]:
        """Adds output text; returns (content that can be sent now, calls completed now)."""
        self.buffer += text
        content, calls = [], []
        while True:
            if self.in_call:
                end = self.buffer.find(TOOL_CALL_CLOSE)
                if end < 0:
                    break
                block = self.buffer[:end]
                self.buffer = self.buffer[end + len(TOOL_CALL_CLOSE):]
                self.in_call = False
                call = parse_call(block.strip())
                if call is None:
                    content.append(TOOL_CALL_OPEN + block + TOOL_CALL_CLOSE)
                else:
                    calls.append(call)
            else:
                start = self.buffer.find(TOOL_CALL_OPEN)
                if start < 0:
                    keep = partial_suffix(self.buffer, TOOL_CALL_OPEN)
                    content.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                content.append(self.buffer[:start])
                self.buffer = self.buffer[start + len(TOOL_CALL_OPEN):]
                self.in_call = True
        self.calls += calls
        return "".join(content), calls

    def finish(self) -> str:
        """The text left at the end (an unfinished block goes out as content, as written)."""
        rest = (TOOL_CALL_OPEN if self.in_call else "") + self.buffer
        self.buffer, self.in_call = "", False
        return rest


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(content, calls) of a whole output."""
    parser = ToolCallParser()
    content, calls = parser.feed(text)
    return content + parser.finish(), calls


def tool_choice_constraint(tools: list[dict], tool_choice: str, params):
    """LLM.chat's params for tool_choice: unchanged for "auto", the grammar of one call for "required"
    (any of the tools) or a function's name (that one)."""
    import dataclasses

    try:
        functions = [t["function"] if t.get("type") == "function" else t for t in tools]
        names = [f["name"] for f in functions]
    except (AttributeError, KeyError, TypeError):
        raise RequestError("tools must be [{'type': 'function', 'function': {'name', 'parameters'}}]") from None
    if tool_choice == "auto":
        return params
    if tool_choice != "required":
        if tool_choice not in names:
            raise RequestError(f"tool_choice must be 'auto', 'required' or one of the tools' names {names}, "
                               f"got {tool_choice!r}")
        functions = [f for f in functions if f["name"] == tool_choice]
    spec = StructuredOutput(tool_call=[{"name": f["name"], "parameters": f.get("parameters")} for f in functions])
    base = [params] if isinstance(params, SamplingParams) or params is None else list(params)
    made = [dataclasses.replace(p or SamplingParams(), structured=spec) for p in base]
    return made[0] if isinstance(params, SamplingParams) or params is None else made


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def openai_tool_calls(calls: list[dict], first_index: int = 0, with_index: bool = False) -> list[dict]:
    """The calls as OpenAI's message.tool_calls (with_index: as a stream's delta.tool_calls)."""
    out = []
    for k, call in enumerate(calls):
        item = {"id": new_call_id(), "type": "function",
                "function": {"name": call["name"], "arguments": call["arguments"]}}
        if with_index:
            item = {"index": first_index + k, **item}
        out.append(item)
    return out


def template_tool_calls(calls: list[dict]) -> list[dict]:
    """An assistant message's OpenAI tool_calls as chat templates take them (arguments as a mapping)."""
    out = []
    for call in calls:
        fn = call["function"]
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError as e:
            raise RequestError(f"tool_calls: the arguments of {fn['name']!r} are not valid JSON: {e}") from None
        out.append({"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}})
    return out
