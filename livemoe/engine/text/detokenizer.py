"""IncrementalDetokenizer: turns a growing list of output token ids into text deltas.

Each push decodes a small window (vLLM's prefix/read offsets): the text of `ids[prefix_offset:]` minus
that of `ids[prefix_offset:read_offset]`. Decoding a window that starts a few tokens back, rather than
the new tokens alone, keeps decoders that look at their neighbours (a SentencePiece leading space)
right, and costs O(new tokens), not O(output length).

UTF-8 safety: a byte-level tokenizer may split one character over several tokens; the decoder turns
the incomplete tail into a single U+FFFD. That last U+FFFD is held back until a later token completes
the character. A character has at most 4 bytes and every token adds at least one, so when
`max_held_tokens` tokens in a row bring no new complete text the bytes are invalid, not incomplete,
and are flushed as the decoder renders them.

Stop strings: the last `len(longest stop) - 1` characters are held back too, so a stop string that
is still being completed is never sent (the engine cuts the text before it).

`finish(final_text)` flushes the rest. Given the engine's non-streaming text it sends exactly what is
missing from it, so the deltas joined equal that text.
"""
import logging

from livemoe.engine.text.prompts import fast_backend

log = logging.getLogger(__name__)

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | tuple = (),
                 max_held_tokens: int = 4):
        assert max_held_tokens >= 1, max_held_tokens
        self.tokenizer = tokenizer
        # two decodes per push, per stream: a fast tokenizer's Rust decode is called directly (transformers'
        # decode adds only its Python overhead when it cleans up no spaces)
        self.backend = None if getattr(tokenizer, "clean_up_tokenization_spaces", True) else fast_backend(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.stop_holdback = max((len(s) for s in stop), default=1) - 1
        self.max_held_tokens = max_held_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # the window to decode starts here
        self.read_offset = 0  # tokens before this are fully turned into text
        self.prefix_text = ""  # decode(ids[prefix_offset:read_offset])
        self.pending_sent = 0  # chars of the text after read_offset already counted as decoded
        self.held_tokens = 0  # tokens in a row that brought no new complete text
        self.decoded = ""  # all complete text so far
        self.text = ""  # what has been sent (decoded minus the stop-string holdback)
        self.finished = False

    def _decode(self, ids: list[int]) -> str:
        if self.backend is not None:
            return self.backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: list[int]) -> str:
        """Adds new output tokens; returns the text that can be sent now (may be empty)."""
        assert not self.finished, "push after finish"
        if not token_ids:
            return ""
        self.ids.extend(token_ids)
        if self.tokenizer is None:
            return ""
        full = self._decode(self.ids[self.prefix_offset:])
        pending = full[len(self.prefix_text):]  # (a decoder whose window text is not a prefix: see finish)
        self.held_tokens += len(token_ids)
        if pending.endswith(REPLACEMENT):
            safe = pending[:-1]  # the incomplete character (one U+FFFD) waits
            if len(safe) > self.pending_sent:
                self.held_tokens = 0  # progress: the tail began in this push at the earliest
        if pending.endswith(REPLACEMENT) and self.held_tokens < self.max_held_tokens:
            new, self.pending_sent = safe[self.pending_sent:], max(self.pending_sent, len(safe))
        else:  # complete (or invalid past the cap): the window can move on
            new = pending[self.pending_sent:]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
            self.pending_sent = self.held_tokens = 0
        self.decoded += new
        return self._release(len(self.decoded) - self.stop_holdback)

    def finish(self, final_text: str | None = None, token_ids: list[int] = ()) -> str:
        """The last token_ids and the rest of the text. final_text: the engine's non-streaming text of
        all the tokens (stop strings cut, a stop token left out); without it, the tokens are decoded
        and everything is released."""
        if self.finished:
            return ""
        if final_text is None:
            new = self.push(list(token_ids))
            self.finished = True
            if self.tokenizer is not None and self.read_offset < len(self.ids):
                rest = self._decode(self.ids[self.prefix_offset:])
                self.decoded += rest[len(self.prefix_text) + self.pending_sent:]
            return new + self._release(len(self.decoded))
        self.finished = True
        self.ids.extend(token_ids)
        if not final_text.startswith(self.text):
            # cannot happen for byte-level or SentencePiece decoders; a text clean-up rule that looks
            # across the window edge could do it. Sent text cannot be taken back: say so.
            log.warning("streamed text ...%r is not a prefix of the final text ...%r; the stream's text will "
                        "differ from it", self.text[-40:], final_text[-40:])
            return ""
        new, self.text = final_text[len(self.text):], final_text
        return new

    def _release(self, upto: int) -> str:
        upto = max(upto, len(self.text))
        new = self.decoded[len(self.text):upto]
        self.text += new
        return new
