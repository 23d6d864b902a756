"""Chat messages whose content is a list of parts, as OpenAI and vLLM spell them, to a MultimodalPrompt:

    {"type": "text", "text": "..."}
    {"type": "input_audio", "input_audio": {"data": "<base64 WAV>", "format": "wav"}}
    {"type": "audio_url", "audio_url": {"url": "data:audio/wav;base64,..." | path}}
    {"type": "image_url", "image_url": {"url": "data:image/png;base64,..." | path}}
    {"type": "video_url", "video_url": {"url": "data:image/gif;base64,..." | path}}  (an animated GIF / WebP)

Each media part becomes <start> <placeholder> x n <end> where it stands in the content (n: the tokens its encoder
gives), the rest goes through the chat template as text. Paths are read under `local_root` only.
"""
import uuid

from livemoe.engine.errors import MediaError, RequestError
from livemoe.engine.multimodal.decode import b64, media_bytes
from livemoe.engine.multimodal.media import MediaItem, MultimodalPrompt, PlacedMedia
from livemoe.engine.text.prompts import chat_prompt_ids

MEDIA_PARTS = ("input_audio", "audio_url", "image_url", "video_url")


def process_part(part: dict, name: str, processor, local_root: str | None) -> MediaItem:
    kind = part.get("type")
    if processor is None:
        raise RequestError(f"{name}: content part {kind!r} needs a model that takes media (a Qwen3-Omni-MoE "
                           "thinker); this one takes text only")
    body = part.get(kind)
    if not isinstance(body, dict):
        raise MediaError(f"{name}: a {kind!r} part needs an object {kind!r}")
    if kind == "input_audio":
        if body.get("format", "wav") != "wav":
            raise MediaError(f"{name}: audio format {body.get('format')!r}; only 'wav' is decoded")
        return processor.audio(b64(body.get("data") or "", name), name)
    raw = media_bytes(body.get("url"), name, local_root)
    if kind == "audio_url":
        return processor.audio(raw, name)
    return processor.image(raw, name) if kind == "image_url" else processor.video(raw, name)


def media_chat_prompt(tokenizer, messages: list[dict], processor, local_root: str | None = None,
                      special_tokens_in_content: bool = False, tools: list[dict] | None = None):
    """-> token ids (no media part) or a MultimodalPrompt. processor: the engine's MediaProcessor (None: a text
    model, which refuses media parts)."""
    markers, items, flat = {}, [], []
    for k, m in enumerate(messages):
        content = m.get("content")
        if not isinstance(content, list):
            flat.append(m)
            continue
        text = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind == "text":
                text.append(str(part.get("text", "")))
            elif kind in MEDIA_PARTS:
                item = process_part(part, f"message {k} content part {j} ({kind})", processor, local_root)
                marker = f"livemoe{uuid.uuid4().hex}media{len(items)}"
                markers[marker] = placeholder_ids(processor.omni, item)
                items.append(item)
                text.append(marker)
            else:
                raise RequestError(f"message {k} content part {j}: unknown type {kind!r}; known: text, "
                                   f"{', '.join(MEDIA_PARTS)}")
        flat.append({**m, "content": "".join(text)})
    ids = chat_prompt_ids(tokenizer, flat, special_tokens_in_content, tools, markers or None)
    return ids if not items else MultimodalPrompt(ids, place(ids, items, processor.omni))


def placeholder_ids(omni, item: MediaItem) -> list[int]:
    if item.kind == "audio":
        return [omni.audio_start_token_id] + [omni.audio_token_id] * item.num_tokens + [omni.audio_end_token_id]
    pad = omni.image_token_id if item.kind == "image" else omni.video_token_id
    return [omni.vision_start_token_id] + [pad] * item.num_tokens + [omni.vision_end_token_id]


def place(ids: list[int], items: list[MediaItem], omni) -> list[PlacedMedia]:
    """Each item at its run of placeholders, in order; RequestError when the ids hold placeholders that no item
    put there (special tokens written in a content with special_tokens_in_content)."""
    pads = set(omni.placeholder_ids)
    placed, i, n = [], 0, len(ids)
    for item in items:
        pad = placeholder_ids(omni, item)[1]
        while i < n and ids[i] not in pads:
            i += 1
        if i + item.num_tokens > n or ids[i] != pad or any(t != pad for t in ids[i:i + item.num_tokens]):
            raise RequestError(f"{item.name}: its placeholder tokens are not where it stands in the prompt "
                               "(media placeholder tokens written in a message's text?)")
        placed.append(PlacedMedia(item, i))
        i += item.num_tokens
    if any(t in pads for t in ids[i:]) or sum(t in pads for t in ids) != sum(it.num_tokens for it in items):
        raise RequestError("the prompt holds media placeholder tokens that no media part put there")
    return placed
