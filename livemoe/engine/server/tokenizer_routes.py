"""vLLM's tokenizer routes: POST /tokenize (a prompt, or chat messages through the template), POST /detokenize
and GET /tokenizer_info (the tokenizer's settings and chat template). lm-evaluation-harness probes
/tokenizer_info and then tokenizes through the server (its `tokenizer_backend=remote`). Behind the API key when
one is set, as the /v1 routes.
"""
from fastapi import APIRouter

from livemoe.engine.errors import RequestError
from livemoe.engine.server.protocol import ChatMessage, StrictModel
from livemoe.engine.text.prompts import chat_prompt_ids, encode_text

TOKENIZER_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (the template's own)
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]


def tokenizer_router(server) -> APIRouter:
    """server: the OpenAIServer (its tokenizer, model name, context and tokenizing pool)."""
    router = APIRouter()

    def checked(model: str | None):
        if model is not None:
            server.check_model(model)
        if server.tokenizer is None:
            raise RequestError("this checkpoint has no tokenizer")
        return server.tokenizer

    @router.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        tok = checked(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError("send one of prompt or messages")
        if body.prompt is not None:
            server.check_text_fits(len(body.prompt))
            add = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await server.off_loop(lambda: encode_text(tok, body.prompt, add_special_tokens=add))
        else:
            if body.add_special_tokens:
                raise RequestError("add_special_tokens: the chat template writes the special tokens of messages")
            if not body.add_generation_prompt:
                raise RequestError("add_generation_prompt: false is not supported (the server always adds it)")
            messages = [m.as_template_input() for m in body.messages or []]
            server.check_text_fits(sum(len(m["content"]) for m in messages))
            ids = await server.off_loop(lambda: chat_prompt_ids(tok, messages))
        answer = {"count": len(ids), "max_model_len": server.context_limit, "tokens": ids, "token_strs": None}
        if body.return_token_strs:
            answer["token_strs"] = tok.convert_ids_to_tokens(ids)
        return answer

    @router.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        tok = checked(body.model)
        bad = [t for t in body.tokens if not 0 <= t < len(tok)]
        if bad:
            raise RequestError(f"tokens must be ids in the vocabulary [0, {len(tok)}); got {bad[:5]}")
        return {"prompt": await server.off_loop(lambda: tok.decode(body.tokens))}

    @router.get("/tokenizer_info")
    async def tokenizer_info():
        return tokenizer_info_of(checked(None))

    return router


def tokenizer_info_of(tokenizer) -> dict:
    """vLLM's answer: the tokenizer's init settings (file paths left out; added tokens as their text), its
    class and its chat template."""
    info = {k: _plain(v) for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
            if k not in ("vocab_file", "merges_file", "tokenizer_file", "name_or_path")}
    info["tokenizer_class"] = type(tokenizer).__name__
    for name in ("eos_token", "bos_token", "pad_token", "unk_token"):
        info.setdefault(name, getattr(tokenizer, name, None))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, str):
        info["chat_template"] = template
    return info


def _plain(value):
    """JSON-able: an AddedToken as its text, containers element-wise, anything else JSON lacks as its str."""
    if hasattr(value, "content"):
        return value.content
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
