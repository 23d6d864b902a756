"""Where a request enters the engine: `tokenize_prompt` turns a prompt into token ids (where the request is made:
LLM, AsyncLLM, the server), and `InputProcessor.validate` checks it once, in the engine core that will run it
(the one that knows the vocabulary, the context, the KV cache and compiles grammars). Later layers trust it.
"""
import threading

import torch

from livemoe.engine.errors import RequestError
from livemoe.engine.sampling.params import SamplingParams, check_vocab
from livemoe.engine.sampling.structured import GrammarCompiler
from livemoe.engine.text.prompts import encode_text


def tokenize_prompt(tokenizer, prompt) -> tuple[str | None, list[int]]:
    """(the prompt's text or None, its token ids): a string is encoded as LLM.generate does (with the tokenizer's
    special tokens); token ids pass as they are."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise RequestError("a text prompt needs a tokenizer, and this checkpoint has none; pass token ids")
        return prompt, encode_text(tokenizer, prompt)
    if isinstance(prompt, (list, tuple)):
        return None, list(prompt)
    if isinstance(prompt, torch.Tensor) and prompt.dim() == 1:
        return None, prompt.tolist()
    raise RequestError(f"a prompt must be a string or a list of token ids, got {type(prompt).__name__}")


class InputProcessor:
    def __init__(self, tokenizer, vocab_size: int, max_model_len: int, eos_token_ids: set[int]):
        self.tokenizer, self.vocab_size, self.max_model_len = tokenizer, vocab_size, max_model_len
        self.eos_token_ids = eos_token_ids
        self._grammar_compiler: GrammarCompiler | None = None  # made at the first structured request
        self._grammar_lock = threading.Lock()

    def validate(self, ids: list[int], params: SamplingParams, kv_capacity: int) -> None:
        """RequestError naming what is wrong; kv_capacity: the tokens the whole KV cache holds."""
        if not ids:
            raise RequestError("the prompt is empty")
        bad = [t for t in ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size]
        if bad:
            raise RequestError(f"prompt token ids must be integers in the vocabulary [0, {self.vocab_size}); "
                               f"got {bad[:5]}")
        if len(ids) >= self.max_model_len:
            raise RequestError(f"the prompt has {len(ids)} tokens; the model's context is {self.max_model_len} "
                               f"(max_model_len), which leaves no room to generate")
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        bad_stop = [t for t in params.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise RequestError(f"stop_token_ids out of the vocabulary [0, {self.vocab_size}): {bad_stop}")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer, and this checkpoint has none; use stop_token_ids")
        check_vocab(params, self.vocab_size)
        if params.structured is not None:
            self.compile_grammar(params.structured)  # a bad schema fails here; the result is cached
        longest = min(len(ids) + params.max_tokens, self.max_model_len)
        if longest > kv_capacity:
            raise RequestError(f"the request needs up to {longest} tokens of KV cache but the cache holds only "
                               f"{kv_capacity}; raise the KV budget or lower max_tokens")

    def grammars(self) -> GrammarCompiler:
        """The livemoe.engine.sampling.structured.GrammarCompiler of this engine (made at first use)."""
        with self._grammar_lock:  # the server's worker threads and the engine thread may both ask first
            if self._grammar_compiler is None:
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids)
            return self._grammar_compiler

    def compile_grammar(self, spec, field: str = "structured"):
        """The compiled grammar of a StructuredOutput (cached by the spec); a bad spec raises RequestError naming
        `field`. AsyncLLM calls it off the event loop before a request reaches the engine loop, which then only
        looks it up."""
        return self.grammars().compile(spec, field)


def check_media(ids: list[int], media: list, omni) -> None:
    """A prompt's PlacedMedia against its ids and the model: RequestError naming what does not fit."""
    if omni is None:
        raise RequestError("this model takes text only; media need a Qwen3-Omni-MoE thinker")
    pad_of = {"audio": omni.audio_token_id, "image": omni.image_token_id, "video": omni.video_token_id}
    end = 0
    for placed in sorted(media, key=lambda m: m.offset):
        item = placed.item
        if item.kind not in pad_of:
            raise RequestError(f"{item.name or 'a media item'}: unknown kind {item.kind!r}")
        if placed.offset < end or placed.end > len(ids) or item.num_tokens < 1:
            raise RequestError(f"{item.name or item.kind}: its tokens [{placed.offset}, {placed.end}) overlap "
                               f"another item or leave the prompt of {len(ids)} tokens")
        if any(t != pad_of[item.kind] for t in ids[placed.offset:placed.end]):
            raise RequestError(f"{item.name or item.kind}: the prompt's tokens there are not its placeholder "
                               f"{pad_of[item.kind]}")
        end = placed.end
