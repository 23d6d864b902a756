"""The reasoning and tool-call splitters: fed whole or cut anywhere into deltas, they give the same
reasoning, content and calls (what makes a server stream join to its JSON answer)."""
import itertools

import pytest

from livemoe.engine.text.reasoning import ReasoningParser, split_reasoning
from livemoe.engine.text.tool_parser import ToolCallParser, parse_tool_calls

CALL = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
REASONING_CASES = {
    # text: (qwen3, deepseek_r1)
    "<think>\nhmm</think>\n\nAnswer": (("\nhmm", "Answer"), ("\nhmm", "Answer")),
    "no think here": ((None, "no think here"), ("no think here", "")),
    "<think>never ends": (("never ends", ""), ("never ends", "")),
    "<thi": ((None, "<thi"), ("<thi", "")),
    "x<think>y</think>z": ((None, "x<think>y</think>z"), ("x<think>y", "z")),
    "r1 style</think>ok": ((None, "r1 style</think>ok"), ("r1 style", "ok")),
}
TOOL_CASES = {
    "pre " + CALL + " mid <tool_call>bad</tool_call><tool_c": (
        "pre  mid <tool_call>bad</tool_call><tool_c", [{"name": "f", "arguments": '{"a": 1}'}]),
    '<tool_call>\n{"name": "g", "arguments": "{\\"b\\": [1]}"}\n</tool_call>': (
        "", [{"name": "g", "arguments": '{"b": [1]}'}]),
    CALL + "\n" + CALL: ("\n", [{"name": "f", "arguments": '{"a": 1}'}] * 2),
    "<tool_call>\n{unfinished": ("<tool_call>\n{unfinished", []),
    "plain text": ("plain text", []),
}


def splits(text: str, pieces: int = 3):
    """Every way to cut text into `pieces` parts (the short texts) or a sample of them."""
    cuts = itertools.combinations(range(len(text) + 1), pieces - 1)
    for k, cut in enumerate(cuts):
        if k % 7:  # a spread sample keeps the test fast
            continue
        bounds = (0, *cut, len(text))
        yield [text[a:b] for a, b in zip(bounds, bounds[1:])]


@pytest.mark.parametrize("kind", ["qwen3", "deepseek_r1"])
def test_reasoning_split_whole_and_streamed(kind):
    assert len(REASONING_CASES) == 6
    for text, expected in REASONING_CASES.items():
        whole = split_reasoning(kind, text)
        assert whole == expected[kind == "deepseek_r1"], text
        n = 0
        for parts in splits(text):
            parser = ReasoningParser(kind)
            fed = [parser.feed(p) for p in parts] + [parser.finish()]
            assert ("".join(r for r, _ in fed) or None, "".join(c for _, c in fed)) == whole, parts
            n += 1
        assert n > 0


def test_tool_calls_whole_and_streamed():
    for text, expected in TOOL_CASES.items():
        assert parse_tool_calls(text) == expected, text
        for parts in splits(text):
            parser = ToolCallParser()
            content, calls = [], []
            for p in parts:
                c, k = parser.feed(p)
                content.append(c)
                calls += k
            content.append(parser.finish())
            assert ("".join(content), calls) == expected, parts


def test_unknown_reasoning_parser():
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        ReasoningParser("nope")
