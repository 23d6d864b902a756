"""A live interval's `audio` and `video` events (the Omni thinker): the interval's own media, encoded for it alone.

    {"type": "audio", "data": "<base64 WAV, 16 kHz>"} | {"type": "audio", "path": "..."}
    {"type": "audio", "waveform": <float array, 16 kHz mono>}                    (Python only)
    {"type": "video", "frames": ["<base64 image or data URL>" | <uint8 RGB array>, ...]}  (at the engine's video_fps)
    {"type": "video", "data": "<base64 animated image>"} | {"type": "video", "path": "..."}

Each becomes a line of the interval's text ("audio: 4.0 s", "video: 8 frames", kept by a compaction, which drops
the media themselves) and its placeholder tokens after the interval's text.
"""
import numpy as np

from livemoe.engine.errors import MediaError, RequestError
from livemoe.engine.multimodal.decode import b64, decode_image, media_bytes
from livemoe.engine.multimodal.media import MediaItem

MEDIA_EVENTS = ("audio", "video")
_FIELDS = {"audio": {"data", "path", "waveform"}, "video": {"data", "path", "frames"}}


def is_media_event(event) -> bool:
    return isinstance(event, dict) and event.get("type") in MEDIA_EVENTS


def media_item(event: dict, name: str, processor, local_root: str | None) -> tuple[MediaItem, str]:
    """-> (the event's item, its line in the interval's text)."""
    kind = event["type"]
    if processor is None:
        raise RequestError(f"{name}: {kind} events need a model that takes media (a Qwen3-Omni-MoE thinker)")
    unknown = sorted(set(event) - _FIELDS[kind] - {"type"})
    given = sorted(set(event) & _FIELDS[kind])
    if unknown or len(given) != 1:
        raise RequestError(f"{name}: a {kind} event has type and one of {sorted(_FIELDS[kind])}; got "
                           f"{sorted(event)}")
    field = given[0]
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
