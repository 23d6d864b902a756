"""Live-session trajectories: the JSONL format of `python -m train.live --data`, and their encoding
into the token layout of livemoe.engine.live.layout.

One session per line:
    {"id": "s1",
     "system": "you are the live assistant ...",                       the session's system prompt
     "products": [{"link": 3, "name": "pork zongzi", "attributes": {"price": "39 yuan", ...}}],   optional
     "intervals": [
        {"t": 10,                                     seconds into the stream (optional: 10 x its 1-based index)
         "events": [{"type": "comment", "user": "amy", "text": "how much is link 3?"}, ...],
                                                                        or one preformatted string
         "decision": {"kind": "ANS", "recipient": "amy", "task": "answer",
                      "message": "link 3 pork zongzi: price is 39 yuan."},
         "recorded": {"kind": "OBS"},       optional: what the recorded trajectory did where it differs from the
                                            reviewed decision (MA-MSFT imitates it; the judge uses "decision")
         "facts": ["link 3 pork zongzi: price is 39 yuan."],             optional: what grounding needs
         "changes": [{"link": 3, "attribute": "price", "value": "29 yuan"}],   optional: room changes
         "questions": [{"user": "amy", "fact": "..."}]},                optional: questions left standing
        ...]}
Event types: comment, gift, join, transcript, frame, meta (livemoe.engine.live.layout), and for a Qwen3-Omni-MoE
thinker audio and video (livemoe.engine.live.media: a WAV or image file by "path", or base64 "data"). Decisions: kind OBS |
MEM (message = the note) | ANS (recipient, task, message); tasks from livemoe.engine.live.decision.TASKS.
"""
import json
from dataclasses import dataclass

from livemoe.engine.errors import DecisionFormatError, RequestError
from livemoe.engine.live.decision import TASKS, Decision
from livemoe.engine.live.layout import encode, render_event, render_events, system_segment
from livemoe.engine.live.media import interval_ids, is_media_event, media_events, media_field
from livemoe.engine.text.json_limits import depth_message, lone_surrogate, too_deep
from livemoe.train.data import DataError


def check_session(s, where: str) -> dict:
    if not isinstance(s, dict):
        raise DataError(f"{where}: a session is a JSON object, got {type(s).__name__}")
    for key, tp in (("id", str), ("system", str), ("intervals", list)):
        if not isinstance(s.get(key), tp):
            raise DataError(f"{where}: field {key!r} must be a {tp.__name__}")
    if not s["intervals"]:
        raise DataError(f"{where}: a session needs at least one interval")
    for i, iv in enumerate(s["intervals"]):
        at = f"{where} intervals[{i}]"
        if not isinstance(iv, dict) or "events" not in iv or not isinstance(iv.get("decision"), dict):
            raise DataError(f"{at}: an interval needs events and a decision object")
        if "recorded" in iv and not isinstance(iv["recorded"], dict):
            raise DataError(f"{at}: recorded must be a decision object")
        t = iv.get("t")
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or t < 0):
            raise DataError(f"{at}: t must be a number of seconds >= 0, got {t!r}")
        try:
            if isinstance(iv["events"], list):  # a media event's medium is read when it is encoded, its shape now
                for j, e in enumerate(iv["events"]):
                    (media_field if is_media_event(e) else render_event)(e, f"events[{j}]")
            else:
                render_events(iv["events"])
            for key in ("decision", "recorded"):
                if key in iv:
                    _check_decision(iv[key], key)
        except (RequestError, DecisionFormatError) as e:
            raise DataError(f"{at}: {e}") from None
        for key in ("facts", "changes", "questions"):
            if key in iv and not isinstance(iv[key], list):
                raise DataError(f"{at}: {key!r} must be a list")
    return s


def _check_decision(d: dict, key: str) -> None:
    unknown = sorted(set(d) - {"kind", "recipient", "task", "message"})
    if unknown:
        raise DecisionFormatError(f"unknown {key} field(s) {unknown}")
    dec = Decision(d.get("kind"), d.get("recipient"), d.get("task"), d.get("message"))
    if dec.kind == "ANS" and dec.task not in TASKS:
        raise DecisionFormatError(f"{key}: task {dec.task!r} is not one of {TASKS}")


def load_sessions(path: str) -> list:
    sessions = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            if too_deep(line) is not None:
                raise DataError(f"{path}:{n}: {depth_message()}")
            try:
                s = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
            if (why := lone_surrogate(s)) is not None:
                raise DataError(f"{path}:{n}: {why}")
            sessions.append(check_session(s, f"{path}:{n}"))
    if not sessions:
        raise DataError(f"{path}: no sessions")
    return sessions


def save_sessions(sessions: list, path: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for s in sessions:
            f.write(json.dumps(s) + "\n")


@dataclass(slots=True)
class EncodedSession:
    input_ids: list  # the whole session in the layout: system, then per interval events + decision
    decision_spans: list  # [(start, end)] of each interval's decision tokens, the end token included
    kinds: list  # the gold kind of each interval
    media: list  # PlacedMedia in input_ids: the sessions' audio and video events (empty for a text session)


def has_media(sessions: list) -> bool:
    """Whether any interval of the sessions has an audio or video event."""
    return any(isinstance(iv["events"], list) and any(is_media_event(e) for e in iv["events"])
               for s in sessions for iv in s["intervals"])


def interval_time(interval: dict, index: int, interval_s: float = 10.0) -> float:
    """The interval's time as the context shows it: its "t", else interval_s apart from interval_s."""
    t = interval.get("t")
    return (index + 1) * interval_s if t is None else t


def interval_tokens(interval: dict, index: int, tokenizer, processor, start: int) -> tuple[list, list]:
    """One interval's token ids (the user turn and the assistant header) after `start` tokens of context, and
    its media placed there: livemoe.engine.live.media's layout, a LiveSession's to the token. processor: the
    engine's MediaProcessor (None for a text model, which refuses audio and video events)."""
    events, items = media_events(interval["events"], processor, "/")
    return interval_ids(tokenizer, processor, render_events(events, interval_time(interval, index)), index > 0, items,
                        start)


def encode_session(session: dict, tokenizer, eos_id: int, decisions: list | None = None,
                   recorded: bool = False, processor=None) -> EncodedSession:
    """The session's token ids as a LiveSession would see them (no compaction). decisions: per interval
    the decision text to put in context (default: the reviewed ones; recorded=True: the recorded
    trajectory's, livemoe.train.live.world.recorded_decision). processor: see interval_tokens."""
    from livemoe.train.live.world import decision_text, recorded_decision

    ids = encode(tokenizer, system_segment(session["system"]))
    spans, kinds, media = [], [], []
    for i, iv in enumerate(session["intervals"]):
        seg, placed = interval_tokens(iv, i, tokenizer, processor, len(ids))
        ids += seg
        media += placed
        text = decision_text(iv, recorded) if decisions is None else decisions[i]
        start = len(ids)
        ids += encode(tokenizer, text) + [eos_id]
        spans.append((start, len(ids)))
        kinds.append((recorded_decision(iv) if recorded else iv["decision"])["kind"])
    return EncodedSession(ids, spans, kinds, media)
