"""Reasoning content: `<think>...</think>` split off a reasoning model's output.

  qwen3        the output may open with `<think>`; what follows until `</think>` is reasoning. An output
               that does not open with `<think>` is all content; one whose think block never closes
               (max_tokens reached) is all reasoning.
  deepseek_r1  the chat template opens the think block in the prompt: the output starts inside it (a
               leading `<think>` is dropped) until `</think>`; without `</think>` it is all reasoning.

Newlines right after `</think>` are dropped from the content. `ReasoningParser` takes the output whole
or as streamed deltas; the non-streaming answer feeds the whole text through it, so a stream's deltas
join to exactly the non-streaming reasoning and content. `max_tokens` counts both parts.
"""
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
REASONING_PARSERS = ("qwen3", "deepseek_r1")


def partial_suffix(text: str, marker: str) -> int:
    """The length of the longest suffix of text that is a proper prefix of marker (it may still become it:
    a streaming splitter holds it back)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class ReasoningParser:
    def __init__(self, kind: str):
        if kind not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {kind!r}; choose one of {REASONING_PARSERS}")
        self.kind = kind
        self.state = "start"  # start (deciding) -> reasoning -> after (dropping newlines) -> content
        self.buffer = ""

    def feed(self, text: str) -> tuple[str, str]:
        """Adds output text; returns (reasoning, content) that can be sent now."""
        self.buffer += text
        reasoning, content = [], []
        while self.buffer:
            if self.state == "start":
                if THINK_OPEN.startswith(self.buffer) and len(self.buffer) < len(THINK_OPEN):
                    break  # may still become <think>
                if self.buffer.startswith(THINK_OPEN):
                    self.buffer = self.buffer[len(THINK_OPEN):]
                    self.state = "reasoning"
                else:
                    self.state = "reasoning" if self.kind == "deepseek_r1" else "content"
            elif self.state == "reasoning":
                end = self.buffer.find(THINK_CLOSE)
                if end < 0:
                    keep = partial_suffix(self.buffer, THINK_CLOSE)
                    reasoning.append(self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    break
                reasoning.append(self.buffer[:end])
                self.buffer = self.buffer[end + len(THINK_CLOSE):]
                self.state = "after"
            elif self.state == "after":
                self.buffer = self.buffer.lstrip("\n")
                if self.buffer:
                    self.state = "content"
            else:
                content.append(self.buffer)
                self.buffer = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The text held back at the end."""
        rest, self.buffer = self.buffer, ""
        if self.state == "start":  # ended while it might still have been <think>
            return (rest, "") if self.kind == "deepseek_r1" else ("", rest)
        if self.state == "reasoning":
            return rest, ""
        return "", rest.lstrip("\n") if self.state == "after" else rest


def think_token_ids(tokenizer) -> tuple[int, int] | None:
    """The ids of <think> and </think> when the tokenizer has each as one token (Qwen3, DeepSeek-R1), else
    None: then a constraint cannot tell where the answer starts and applies to the whole output."""
    ids = [tokenizer.encode(marker, add_special_tokens=False) for marker in (THINK_OPEN, THINK_CLOSE)]
    return (ids[0][0], ids[1][0]) if all(len(i) == 1 for i in ids) else None


def split_reasoning(kind: str, text: str) -> tuple[str | None, str]:
    """(reasoning or None when there is none, content) of a whole output."""
    parser = ReasoningParser(kind)
    r1, c1 = parser.feed(text)
    r2, c2 = parser.finish()
    return (r1 + r2) or None, c1 + c2
