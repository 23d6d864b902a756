"""A chat choice's text turned into the message fields: `reasoning_content` (the server's
--reasoning-parser), `content`, and `tool_calls` (the Qwen3 / Hermes parser, when the request has tools
and tool_choice is not "none"; `function_call`, the legacy shape of one call, when the request sent `functions`).
The same parser serves the JSON answer (the whole text fed at once)
and the event stream (deltas), so a stream joins to exactly the JSON answer's message.
"""
from livemoe.engine.text.reasoning import ReasoningParser
from livemoe.engine.text.tool_parser import ToolCallParser, openai_tool_calls


class ChoiceParser:
    def __init__(self, reasoning: str | None, tools: bool, legacy_functions: bool = False):
        self.reasoning = ReasoningParser(reasoning) if reasoning else None
        self.tools = ToolCallParser() if tools else None
        self.legacy = legacy_functions
        self.num_calls = 0

    @property
    def active(self) -> bool:
        return self.reasoning is not None or self.tools is not None

    def feed(self, text: str, last: bool = False) -> dict:
        """A stream delta's fields for this text (last: flush what was held back)."""
        reasoning, content = ("", text) if self.reasoning is None else self.reasoning.feed(text)
        if last and self.reasoning is not None:
            r, c = self.reasoning.finish()
            reasoning, content = reasoning + r, content + c
        calls = []
        if self.tools is not None:
            content, calls = self.tools.feed(content)
            if last:
                content += self.tools.finish()
        delta = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if calls and self.legacy:
            # the legacy shape holds one call: the first (a model that writes several in auto mode loses the rest)
            if not self.num_calls:
                delta["function_call"] = dict(calls[0])
            self.num_calls += len(calls)
        elif calls:
            delta["tool_calls"] = openai_tool_calls(calls, self.num_calls, with_index=True)
            self.num_calls += len(calls)
        return delta

    def message(self, text: str) -> dict:
        """The JSON answer's message for the whole text."""
        fields = self.feed(text, last=True)
        message = {"role": "assistant", "content": fields.get("content")}
        if self.reasoning is not None:
            message["reasoning_content"] = fields.get("reasoning_content")
        if self.tools is not None and self.legacy:
            message["function_call"] = fields.get("function_call")
        elif self.tools is not None:
            message["tool_calls"] = [{k: v for k, v in c.items() if k != "index"} for c in fields.get("tool_calls", [])]
        return message

    def finish_reason(self, reason: str | None) -> str | None:
        """A choice that ended by itself after calling tools finishes with "tool_calls" (OpenAI's; "function_call"
        in the legacy shape)."""
        if reason == "stop" and self.num_calls:
            return "function_call" if self.legacy else "tool_calls"
        return reason
