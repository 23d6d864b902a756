"""A live interval's `audio` and `video` events (the Omni thinker): the interval's own media, encoded for it alone.

    {"type": "audio", "data": "<base64 WAV, 16 kHz>"} | {"type": "audio", "path": "..."}
    {"type": "audio", "waveform": <float array, 16 kHz mono>}                    (Python only)
    {"type": "video", "frames": ["<base64 image or data URL>" | <uint8 RGB array>, ...]}  (at the engine's video_fps)
    {"type": "video", "data": "<base64 animated image>"} | {"type": "video", "path": "..."}

Each becomes a line of the interval's text ("audio: 4.0 s", "video: 8 frames", kept by a compaction, which drops
the media themselves) and its placeholder tokens before the interval's text.
"""
import numpy as np

from livemoe.engine.errors import MediaError, RequestError
from livemoe.engine.live.layout import encode, interval_segment, interval_segments, render_event
from livemoe.engine.multimodal.chat import placeholder_ids
from livemoe.engine.multimodal.decode import b64, decode_image, media_bytes
from livemoe.engine.multimodal.media import MediaItem, PlacedMedia

MEDIA_EVENTS = ("audio", "video")
_FIELDS = {"audio": {"data", "path", "waveform"}, "video": {"data", "path", "frames"}}


def is_media_event(event) -> bool:
    return isinstance(event, dict) and event.get("type") in MEDIA_EVENTS


def media_events(events, processor, local_root: str | None) -> tuple:
    """(the interval's events with each media event as its text line, the media items in order): what a LiveSession
    and the live trainers (livemoe.train.live.data) both lay out. Events without media come back as they are."""
    if not (isinstance(events, (list, tuple)) and any(is_media_event(e) for e in events)):
        return events, []
    lines, items = [], []
    for i, e in enumerate(events):
        if is_media_event(e):
            item, line = media_item(e, f"events[{i}]", processor, local_root)
            items.append(item)
            lines.append(line)
        else:
            lines.append(render_event(e, f"events[{i}]"))
    return "\n".join(lines), items


def interval_ids(tokenizer, processor, text: str, after_decision: bool, items: list, start: int) -> tuple[list, list]:
    """An interval's token ids, to follow `start` tokens of context, and its items placed in the whole context
    (PlacedMedia offsets from its first token): the user header, each item's placeholders, then the text and the
    assistant header."""
    if not items:
        return encode(tokenizer, interval_segment(text, after_decision)), []
    before, after = interval_segments(text, after_decision)
    ids, placed = encode(tokenizer, before), []
    omni = processor.omni  # there are items: media_item had a processor
    for item in items:
        block = placeholder_ids(omni, item)
        placed.append(PlacedMedia(item, start + len(ids) + 1))
        ids += block
    return ids + encode(tokenizer, after), placed


def media_field(event: dict, name: str) -> str:
    """The field that holds a media event's medium; RequestError when it has not exactly one or has others."""
    kind = event["type"]
    unknown = sorted(set(event) - _FIELDS[kind] - {"type"})
    given = sorted(set(event) & _FIELDS[kind])
    if unknown or len(given) != 1:
        raise RequestError(f"{name}: a {kind} event has type and one of {sorted(_FIELDS[kind])}; got "
                           f"{sorted(event)}")
    return given[0]


def media_item(event: dict, name: str, processor, local_root: str | None) -> tuple[MediaItem, str]:
    """-> (the event's item, its line in the interval's text)."""
    kind = event["type"]
    if processor is None:
        raise RequestError(f"{name}: {kind} events need a model that takes media (a Qwen3-Omni-MoE thinker)")
    field = media_field(event, name)
    value = event[field]
    if kind == "audio":
        if field == "waveform":
            item = processor.audio_waveform(np.asarray(value, np.float32).reshape(-1), name)
        else:
            item = processor.audio(_raw(value, field, name, local_root), name)
        return item, f"audio: {item.data.shape[1] / 100:.1f} s"
    if field == "frames":
        if not isinstance(value, (list, tuple)) or not value:
            raise MediaError(f"{name}: frames must be a non-empty list of images")
        frames = [f if isinstance(f, np.ndarray) else decode_image(_raw(f, "frames", f"{name} frame {i}", None), name)
                  for i, f in enumerate(value)]
        item = processor.video_frames(frames, name)
        return item, f"video: {len(frames)} frames"
    item = processor.video(_raw(value, field, name, local_root), name)
    return item, f"video: {item.grid_thw[0] * processor.temporal_patch} frames"


def _raw(value, field: str, name: str, local_root: str | None) -> bytes:
    if not isinstance(value, str):
        raise MediaError(f"{name}: {field} must be a string, got {type(value).__name__}")
    if field == "path":
        return media_bytes(value, name, local_root)
    return media_bytes(value, name, None) if value.startswith("data:") else b64(value, name)
