"""How a live session's context is laid out as text: the same layout serves the engine's LiveSession
and the trainers (livemoe.train.live), so the policy is trained on exactly what it sees when serving.

    <|im_start|>system\\n{system}<|im_end|>\\n
    [<|im_start|>memory\\n{note}\\n{note}...<|im_end|>\\n]          only after a compaction
    <|im_start|>user\\n{interval's events}<|im_end|>\\n<|im_start|>assistant\\n{decision}<EOS>\\n
    <|im_start|>user\\n...

Each segment is tokenized on its own and the segments' ids are concatenated, so the ids of what came
before never change when an interval is appended (the session's KV cache stays valid). The decision is
the policy's own tokens followed by the end token; the "\\n" after it opens the next interval.

Events are one interval's list of {"type", "user", "text"} dicts, one line each:
    comment @amy: what is the price of link 3?      gift @bob: rocket          join @carl
    transcript host: link 3 is now 29 yuan.          frame: the host holds up the pork zongzi.
    meta: viewers 120.
Audio and video enter as text (transcript from ASR, frame captions), or, on a Qwen3-Omni-MoE thinker, as themselves:
`audio` and `video` events (livemoe.engine.live.media) put a line in the text and their placeholder tokens between
the interval's user header and its text (interval_segments' two halves).
"""
from livemoe.engine.errors import RequestError

EVENT_TYPES = ("comment", "gift", "join", "transcript", "frame", "meta")
_NEEDS_USER = ("comment", "gift", "join")
_NEEDS_TEXT = ("comment", "gift", "transcript", "frame", "meta")


def render_event(event: dict, where: str = "event") -> str:
    if not isinstance(event, dict):
        raise RequestError(f"{where}: an event is an object with type, user and text, got {type(event).__name__}")
    unknown = sorted(set(event) - {"type", "user", "text"})
    if unknown:
        raise RequestError(f"{where}: unknown field(s) {unknown}; an event has type, user, text")
    kind, user, text = event.get("type"), event.get("user"), event.get("text")
    if kind not in EVENT_TYPES:
        raise RequestError(f"{where}.type must be one of {EVENT_TYPES}, got {kind!r}")
    for name, value in (("user", user), ("text", text)):
        if value is not None and not isinstance(value, str):
            raise RequestError(f"{where}.{name} must be a string, got {type(value).__name__}")
        if value is not None and "\n" in value:
            raise RequestError(f"{where}.{name} must be one line (no newline)")
    if kind in _NEEDS_USER and not user:
        raise RequestError(f"{where}: a {kind} event needs a user")
    if kind in _NEEDS_TEXT and not text:
        raise RequestError(f"{where}: a {kind} event needs a text")
    if kind == "join":
        return f"join @{user}"
    if kind in ("comment", "gift"):
        return f"{kind} @{user}: {text}"
    if kind == "transcript":
        return f"transcript {user or 'host'}: {text}"
    return f"{kind}: {text}"


def render_events(events, t: float | None = None) -> str:
    """One interval's events as text (a preformatted string is taken as it is)."""
    if isinstance(events, str):
        if "<|im_" in events:
            raise RequestError("events text must not contain chat markers (<|im_start|>, <|im_end|>)")
        body = events.strip()
    elif isinstance(events, (list, tuple)):
        body = "\n".join(render_event(e, f"events[{i}]") for i, e in enumerate(events))
    else:
        raise RequestError(f"events must be a list of event objects or a string, got {type(events).__name__}")
    head = f"t={t:g}s" if t is not None else ""
    return "\n".join(x for x in (head, body or "(nothing)") if x)


def system_segment(system: str) -> str:
    return f"<|im_start|>system\n{system}<|im_end|>\n"


def memory_segment(notes: list) -> str:
    return "<|im_start|>memory\n" + "\n".join(notes) + "<|im_end|>\n"


def interval_segment(events_text: str, after_decision: bool) -> str:
    """The interval's user turn and the assistant header (after a decision, the "\\n" that ends it)."""
    return "".join(interval_segments(events_text, after_decision))


def interval_segments(events_text: str, after_decision: bool) -> tuple[str, str]:
    """interval_segment cut where an interval's media go: after its user header, before its text. The text stays
    next to the decision: media between a viewer's comment and the assistant header push the name the decision
    copies dozens of tokens away (docs/multimodal.md, the recipient accuracy it cost)."""
    return ("\n" if after_decision else "") + "<|im_start|>user\n", f"{events_text}<|im_end|>\n<|im_start|>assistant\n"


def encode(tokenizer, text: str) -> list:
    return tokenizer.encode(text, add_special_tokens=False)
