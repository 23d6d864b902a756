"""The Responses API's shaping (livemoe.engine.server.responses_api) on scripted deltas: reasoning (the qwen3
parser), text and a tool call become reasoning, message and function_call items; the stream's events are
accepted by the openai SDK's own accumulator (what `client.responses.stream` runs) and end in the JSON answer's
Response; and each request maps onto the chat request it means."""
import asyncio
import json

import pytest

from fixtures import require_server_extras

openai = require_server_extras()

from livemoe.engine.errors import RequestError  # noqa: E402
from livemoe.engine.server.chat_output import ChoiceParser  # noqa: E402
from livemoe.engine.server.responses_api import ResponseShape, ResponsesRequest  # noqa: E402
from livemoe.engine.text.streaming import StreamDelta  # noqa: E402

PIECES = ["<think>I should", " look it up</think>", "Let me check.", '<tool_call>\n{"name": "lookup", ',
          '"arguments": {"id": 12}}\n</tool_call>']


class FakeServer:
    model_name = "tiny"


class FakeRun:
    """What ResponseShape reads of a responses.Run."""

    def __init__(self, pieces, finish="stop"):
        self.server, self.pieces, self.finish = FakeServer(), pieces, finish
        self.parsers = [ChoiceParser("qwen3", tools=True)]

    async def deltas(self):
        for k, text in enumerate(self.pieces):
            last = k == len(self.pieces) - 1
            yield 0, StreamDelta("r", 0, [k], text, finish_reason=self.finish if last else None)

    def _usage(self):
        return {"prompt_tokens": 7, "completion_tokens": len(self.pieces), "total_tokens": 7 + len(self.pieces),
                "prompt_tokens_details": {"cached_tokens": 3}}


def shape(pieces=PIECES, finish="stop", **body):
    request = ResponsesRequest.model_validate({"model": "tiny", "input": "x", **body})
    return ResponseShape(FakeRun(pieces, finish), request, lambda text: len(text.split()))


async def events(s: ResponseShape) -> list[dict]:
    out = []
    async for chunk in s.events():
        head, data = chunk.decode().rstrip("\n").split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert head == "event: " + event["type"]
        out.append(event)
    return out


def test_items_in_order_and_the_stream_joins_to_the_json_answer():
    answer = asyncio.run(shape().collect())
    assert [i["type"] for i in answer["output"]] == ["reasoning", "message", "function_call"]
    reasoning, message, call = answer["output"]
    assert reasoning["content"] == [{"type": "reasoning_text", "text": "I should look it up"}]
    assert message["content"][0]["text"] == "Let me check." and message["status"] == "completed"
    assert (call["name"], json.loads(call["arguments"])) == ("lookup", {"id": 12})
    assert answer["status"] == "completed" and answer["incomplete_details"] is None
    assert answer["usage"] == {"input_tokens": 7, "input_tokens_details": {"cached_tokens": 3}, "output_tokens": 5,
                               "output_tokens_details": {"reasoning_tokens": 5}, "total_tokens": 12}

    from openai._models import construct_type_unchecked
    from openai._types import omit
    from openai.lib.streaming.responses._responses import ResponseStreamState
    from openai.types.responses import ResponseStreamEvent

    streamed = asyncio.run(events(shape()))
    assert [e["sequence_number"] for e in streamed] == list(range(len(streamed)))
    state = ResponseStreamState(input_tools=omit, text_format=omit)  # the SDK's responses.stream accumulator
    for e in streamed:
        state.handle_event(construct_type_unchecked(type_=ResponseStreamEvent, value=e))
    final = streamed[-1]["response"]
    assert streamed[-1]["type"] == "response.completed"
    strip = [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in final["output"]]
    assert strip == [{k: v for k, v in i.items() if k not in ("id", "call_id")} for i in answer["output"]]
    deltas = [e["delta"] for e in streamed if e["type"] == "response.reasoning_text.delta"]
    assert "".join(deltas) == "I should look it up"


def test_running_out_of_tokens_is_incomplete():
    s = shape(["<think>still", " thinking"], finish="length", max_output_tokens=2)
    streamed = asyncio.run(events(s))
    assert streamed[-1]["type"] == "response.incomplete"
    final = streamed[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete" and final["max_output_tokens"] == 2


def test_requests_map_onto_the_chat_request_they_mean():
    request = ResponsesRequest.model_validate({
        "model": "tiny", "instructions": "be brief", "max_output_tokens": 9, "temperature": 0.5, "top_p": 0.9,
        "input": [{"role": "developer", "content": "use tools"},
                  {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "link 12?"}]},
                  {"type": "reasoning", "id": "rs_1", "summary": []},
                  {"type": "function_call", "call_id": "c1", "name": "lookup", "arguments": '{"id": 12}'},
                  {"type": "function_call", "call_id": "c2", "name": "lookup", "arguments": '{"id": 13}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "zongzi"}],
        "tools": [{"type": "function", "name": "lookup", "parameters": {"type": "object"}}],
        "tool_choice": {"type": "function", "name": "lookup"},
        "text": {"format": {"type": "json_object"}}, "ignore_eos": False, "stop": None})
    chat = request.as_chat()
    assert [m.role for m in chat.messages] == ["system", "developer", "user", "assistant", "tool"]
    assert [c.id for c in chat.messages[3].tool_calls] == ["c1", "c2"]  # one turn's calls in one message
    assert (chat.max_tokens, chat.temperature, chat.top_p) == (9, 0.5, 0.9)
    assert chat.tool_mode() == "named" and chat.tools[0].function.name == "lookup"
    # a forced call leaves no text for text.format to shape: its grammar alone applies (instructor's
    # RESPONSES_TOOLS sends both)
    assert chat.response_format is None and chat.constraint()[1] == "tools"
    free = request.model_copy(update={"tool_choice": "auto"}).as_chat()
    assert free.response_format.type == "json_object" and free.tool_mode() == "auto"
    with pytest.raises(RequestError, match="input has no message"):
        ResponsesRequest.model_validate({"model": "tiny", "input": []}).as_chat()
