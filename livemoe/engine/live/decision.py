"""The decision a live session makes each interval, as text the policy writes and a parser reads.

One line, in one of three shapes (the grammar the decoder is held to, `decision_regex`):
    OBS                                       stay silent
    MEM <note>                                a private memory note (a fact worth keeping)
    ANS @<recipient> <task>: <message>        a message to one viewer, for one task

Recipients are viewer names ([A-Za-z0-9_], at most 24 characters); tasks come from a closed list
(`TASKS` by default); notes and messages are printable ASCII without newlines, bounded in length so a
constrained decode always ends within its token budget (a byte-level vocabulary has a token per
character, so characters <= tokens).
"""
import re
from dataclasses import dataclass, field

from livemoe.engine.errors import DecisionFormatError

KINDS = ("OBS", "MEM", "ANS")
TASKS = ("answer", "thank", "welcome", "correct")
MAX_RECIPIENT_CHARS = 24
MAX_MESSAGE_CHARS = 160
_RECIPIENT = rf"[A-Za-z0-9_]{{1,{MAX_RECIPIENT_CHARS}}}"


@dataclass(slots=True)
class DecisionMetrics:
    prompt_tokens: int = 0  # the interval's whole context, as the step's prompt
    cached_prompt_tokens: int = 0  # of those, served from the KV cache (not prefilled)
    completion_tokens: int = 0  # the decision's tokens, the end token included
    latency_s: float = 0.0  # wall time of step(), events in to decision out
    decode_flops: int = 0  # livemoe.engine.model.flops.decode_flops over the completion tokens
    compacted: bool = False  # this step compacted the context (and re-prefilled it)
    compaction_tokens: int = 0  # tokens the compaction re-prefilled (its cost)


@dataclass(slots=True)
class Decision:
    kind: str
    recipient: str | None = None
    task: str | None = None
    message: str | None = None  # the MEM note or the ANS message
    metrics: DecisionMetrics = field(default_factory=DecisionMetrics, compare=False)

    def __post_init__(self):
        if self.kind not in KINDS:
            raise DecisionFormatError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind == "ANS" and not (self.recipient and self.task and self.message):
            raise DecisionFormatError("an ANS decision needs a recipient, a task and a message")
        if self.kind == "MEM" and not self.message:
            raise DecisionFormatError("a MEM decision needs a note (message)")
        if self.kind != "ANS" and (self.recipient or self.task):
            raise DecisionFormatError(f"a {self.kind} decision has no recipient or task")
        if self.kind == "OBS" and self.message:
            raise DecisionFormatError("an OBS decision has no message")

    @property
    def text(self) -> str:
        return format_decision(self.kind, self.recipient, self.task, self.message)

    def to_json(self) -> dict:
        return {"kind": self.kind, "recipient": self.recipient, "task": self.task, "message": self.message}


def format_decision(kind: str, recipient: str | None = None, task: str | None = None,
                    message: str | None = None) -> str:
    if kind == "OBS":
        return "OBS"
    if kind == "MEM":
        return f"MEM {message}"
    if kind == "ANS":
        return f"ANS @{recipient} {task}: {message}"
    raise DecisionFormatError(f"kind must be one of {KINDS}, got {kind!r}")


def decision_regex(tasks=TASKS, max_message_chars: int = MAX_MESSAGE_CHARS) -> str:
    """The decision grammar as a regex (for SamplingParams(structured=StructuredOutput(regex=...)))."""
    if not tasks or not all(re.fullmatch(r"[a-z_]+", t) for t in tasks):
        raise ValueError(f"tasks must be a non-empty list of lower-case words, got {tasks!r}")
    text = rf"[ -~]{{1,{max_message_chars}}}"
    return rf"OBS|MEM {text}|ANS @{_RECIPIENT} ({'|'.join(tasks)}): {text}"


def max_decision_chars(tasks=TASKS, max_message_chars: int = MAX_MESSAGE_CHARS) -> int:
    """The longest text the grammar allows (a token budget of this + 1 always reaches the end token)."""
    return len("ANS @") + MAX_RECIPIENT_CHARS + 1 + max(map(len, tasks)) + 2 + max_message_chars


_ANS = re.compile(rf"ANS @({_RECIPIENT}) ([a-z_]+): (.+)", re.DOTALL)


def parse_decision(text: str, tasks=TASKS) -> Decision:
    """The Decision a text holds (surrounding whitespace ignored); DecisionFormatError otherwise."""
    if not isinstance(text, str):
        raise DecisionFormatError(f"a decision is text, got {type(text).__name__}")
    s = text.strip()
    if s == "OBS":
        return Decision("OBS")
    if s.startswith("MEM "):
        note = s[4:].strip()
        if not note or "\n" in note:
            raise DecisionFormatError(f"MEM needs a one-line note, got {text!r}")
        return Decision("MEM", message=note)
    m = _ANS.fullmatch(s)
    if m:
        recipient, task, message = m.group(1), m.group(2), m.group(3).strip()
        if task not in tasks:
            raise DecisionFormatError(f"task {task!r} is not one of {tuple(tasks)}")
        if not message or "\n" in message:
            raise DecisionFormatError(f"ANS needs a one-line message, got {text!r}")
        return Decision("ANS", recipient, task, message)
    head = s.split(" ", 1)[0][:12]
    raise DecisionFormatError(f"not a decision (OBS | MEM <note> | ANS @<recipient> <task>: <message>): "
                              f"starts with {head!r}")
