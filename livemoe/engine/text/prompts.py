"""Text prompts and chat conversations to token ids, as LLM and the HTTP server both make them.

Special tokens spelled inside a message's content (`<|im_start|>system` in a user's text) are tokenized
as plain text, so a user cannot forge turns of another role; only the chat template's own special
tokens are special. A caller that means them opts in with `special_tokens_in_content=True`.
Text that is not valid Unicode (a lone surrogate from a JSON `\\ud800` escape) is a RequestError.
"""
import re
import uuid

from livemoe.engine.errors import RequestError


def encode_text(tokenizer, text: str, what: str = "the prompt", **kw) -> list[int]:
    """tokenizer.encode(text, **kw), refusing text that is not valid Unicode first (a RequestError, not a
    tokenizer's panic). A fast tokenizer's Rust backend is called directly when nothing but special
    tokens is asked for: the same ids, without transformers' per-call padding and truncation set-up (on
    a short prompt that was over half the call, on the server's event loop for every request)."""
    check_unicode(text, what)
    backend = fast_backend(tokenizer)
    if backend is not None and set(kw) <= {"add_special_tokens"}:
        return backend.encode(text, add_special_tokens=kw.get("add_special_tokens", True)).ids
    return tokenizer.encode(text, **kw)


def fast_backend(tokenizer):
    """The Rust tokenizer (`tokenizers.Tokenizer`) behind a transformers fast tokenizer; None for another kind."""
    return getattr(tokenizer, "backend_tokenizer", None) if getattr(tokenizer, "is_fast", False) else None


def check_unicode(text: str, what: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(f"{what} is not valid Unicode: {e.reason} at character {e.start} "
                           f"({text[e.start:e.end]!r})") from None


def chat_prompt_ids(tokenizer, messages: list[dict], special_tokens_in_content: bool = False,
                    tools: list[dict] | None = None, media_markers: dict[str, list[int]] | None = None) -> list[int]:
    """The token ids of `messages` under the tokenizer's chat template, with the generation prompt (the
    template writes any special tokens itself: none are added); `tools` go to the template. media_markers: strings the
    contents hold (unique, plain text) that become the given ids, not text (a media item's placeholders)."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise RequestError("this model has no chat template (use a completions prompt)")
    for k, m in enumerate(messages):
        if isinstance(m.get("content"), str):
            check_unicode(m["content"], f"message {k}'s content")
    specials = [t.content for t in tokenizer.added_tokens_decoder.values() if t.special]
    forged = [k for k, m in enumerate(messages)
              if isinstance(m.get("content"), str) and any(s in m["content"] for s in specials)]
    if special_tokens_in_content or not forged:
        return _encode(tokenizer, _render(tokenizer, messages, tools), media_markers)
    # render with a marker in place of each such content, then encode those contents as plain text
    markers = {k: f"livemoe{uuid.uuid4().hex}m{k}" for k in forged}
    text = _render(tokenizer, [{**m, "content": markers[k]} if k in markers else m for k, m in enumerate(messages)],
                   tools)
    ids: list[int] = []
    pos = 0
    for k, marker in markers.items():
        at = text.find(marker, pos)
        if at < 0 or text.count(marker) != 1:
            raise RequestError(f"message {k}'s content holds special tokens and the chat template transforms it, "
                               "so it cannot be kept as text; set special_tokens_in_content to use them as tokens")
        ids += _encode(tokenizer, text[pos:at], media_markers)
        ids += _encode(tokenizer, messages[k]["content"], media_markers, split_special_tokens=True)
        pos = at + len(marker)
    return ids + _encode(tokenizer, text[pos:], media_markers)


def _encode(tokenizer, text: str, markers: dict[str, list[int]] | None, **kw) -> list[int]:
    if not markers:
        return tokenizer.encode(text, add_special_tokens=False, **kw)
    ids: list[int] = []
    for piece in re.split("(" + "|".join(map(re.escape, markers)) + ")", text):
        if piece in markers:
            ids += markers[piece]
        elif piece:
            ids += tokenizer.encode(piece, add_special_tokens=False, **kw)
    return ids


def _render(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> str:
    extra = {"tools": tools} if tools else {}
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **extra)
    except Exception as e:  # the template's own checks (e.g. role order) raise jinja errors
        raise RequestError(f"the chat template rejected the messages: {e}") from None
