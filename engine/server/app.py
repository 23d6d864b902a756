"""The OpenAI-compatible HTTP app over an AsyncLLM: /v1/completions, /v1/chat/completions (JSON, or
server-sent events ending with `data: [DONE]`), /v1/models, /health, /metrics.

Every request error is a 400 with an OpenAI error body (bad JSON, a wrong type, an unknown model, a
parameter out of range, a prompt too long for the context); an unexpected failure is a 500 with the
same shape, and the server keeps serving either way. A client that goes away — mid-stream, or while
waiting for a JSON answer — gets its requests aborted, which frees their KV blocks.

A completions body with several prompts makes one engine request per prompt; choice k * n + j is
completion j of prompt k. The non-streaming `usage` carries an extension, `usage.metrics`: TTFT and
TPOT (seconds; the slowest request's TTFT, the token-weighted TPOT), output tokens and decode FLOPs;
a stream's usage event (`stream_options.include_usage`) carries it too.
"""
import asyncio
import dataclasses
import logging
import time
import uuid

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse

from engine.async_llm import AsyncLLM, RequestStream
from engine.sampling import RequestError, SamplingParams
from engine.server.metrics import ServerMetrics
from engine.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from engine.server.responses import Run

log = logging.getLogger("engine.serve")


class ModelNotFound(RequestError):
    pass


def build_app(engine: AsyncLLM, model_name: str, reasoning_parser: str | None = None) -> FastAPI:
    """reasoning_parser: qwen3 or deepseek_r1 splits chat outputs' <think> blocks into reasoning_content."""
    server = OpenAIServer(engine, model_name, reasoning_parser)
    app = FastAPI(title="livemoe", docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError):
        return JSONResponse(error_body(_describe(exc.errors())), status_code=400)

    @app.exception_handler(RequestError)
    async def bad_request(request: Request, exc: RequestError):
        code = "model_not_found" if isinstance(exc, ModelNotFound) else None
        return JSONResponse(error_body(str(exc), code), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), kind="not_found_error" if exc.status_code == 404 else
                                       "invalid_request_error"), status_code=exc.status_code)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):
        log.exception("internal error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {exc!r}", kind="internal_error"), status_code=500)

    @app.get("/health")
    async def health():
        if engine.error is not None:
            return JSONResponse({"status": "dead", "error": str(engine.error)}, status_code=503)
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": server.created,
                                            "owned_by": "livemoe", "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def metrics():
        return Response(server.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        server.check_model(body.model)
        params = body.sampling_params()
        await server.compile_constraint(body)
        prompts = [server.encode(p) for p in body.prompts()]
        return await server.respond(request, body, prompts, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        server.check_model(body.model)
        tools = body.tool_functions() if body.tool_mode() != "none" else None
        ids = server.encode(server.apply_chat_template([m.as_template_input() for m in body.messages], tools),
                            add_special_tokens=False)
        params = server.answer_only_constraint(body.sampling_params(room=max(1, server.context_limit - len(ids))))
        await server.compile_constraint(body)
        return await server.respond(request, body, [ids], params, chat=True)

    return app


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always watches for the client leaving and always cleans up (closes
    its body iterator, then calls on_close), whatever the ASGI spec version of the server."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            async with anyio.create_task_group() as tg:
                async def stream_then_stop():
                    try:
                        await self.stream_response(send)
                    except OSError:  # the client left while we were sending
                        pass
                    tg.cancel_scope.cancel()

                tg.start_soon(stream_then_stop)
                await self.listen_for_disconnect(receive)
                tg.cancel_scope.cancel()
        finally:
            await self.body_iterator.aclose()
            self.on_close()  # also when the client left before the body iterator ever started


class OpenAIServer:
    def __init__(self, engine: AsyncLLM, model_name: str, reasoning_parser: str | None = None):
        from engine.reasoning import REASONING_PARSERS

        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; choose one of {REASONING_PARSERS}")
        self.engine, self.model_name, self.tokenizer = engine, model_name, engine.tokenizer
        self.reasoning_parser = reasoning_parser
        self.think_tokens = None  # with a reasoning parser: (<think>, </think>) ids, when single tokens
        if reasoning_parser is not None and self.tokenizer is not None:
            from engine.reasoning import think_token_ids

            self.think_tokens = think_token_ids(self.tokenizer)
        self.metrics = ServerMetrics(engine.stats)
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}

    # -- request preparation --------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ModelNotFound(f"the model {name!r} does not exist; this server serves {self.model_name!r}")

    @property
    def context_limit(self) -> int:
        """Tokens one sequence may hold: the context, or the whole KV cache if smaller."""
        stats = self.engine.stats()
        return min(self.engine.max_model_len, stats["kv_blocks_total"] * self.engine.llm.config.block_size)

    def encode(self, prompt, add_special_tokens: bool = True) -> list[int]:
        """Token ids as LLM makes them: a text prompt as LLM.generate encodes it; a chat prompt (already
        holding the template's special tokens) as LLM.chat does, adding none."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise RequestError("this model has no tokenizer; send the prompt as token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        return list(prompt)

    def apply_chat_template(self, messages: list[dict], tools: list[dict] | None = None) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template; use /v1/completions")
        try:
            if tools:  # the template renders them (Qwen3's lists them in the system turn)
                return self.tokenizer.apply_chat_template(messages, tools=[{"type": "function", "function": f}
                                                                           for f in tools],
                                                          tokenize=False, add_generation_prompt=True)
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template's own checks (e.g. role order) raise jinja errors
            raise RequestError(f"the chat template rejected the messages: {e}") from None

    def answer_only_constraint(self, params: SamplingParams) -> SamplingParams:
        """With a reasoning parser, a chat's output constraint applies to the answer after the think block
        (engine.structured), as vLLM does; when </think> is not one token it applies to the whole output."""
        if params.structured is None or self.think_tokens is None:
            return params
        return dataclasses.replace(params, structured=dataclasses.replace(params.structured,
                                                                          think_tokens=self.think_tokens))

    async def compile_constraint(self, body) -> None:
        """Compiles the body's output constraint in a worker thread (cached; the engine loop then only
        looks it up); a bad schema, regex or grammar is a 400 naming the field."""
        found = body.constraint()
        if found is not None:
            await asyncio.get_running_loop().run_in_executor(None, self.engine.llm.compile_grammar, *found)

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"<{token_id}>"
            self._token_text[token_id] = text
        return text

    # -- running --------------------------------------------------------------------------------

    async def respond(self, request: Request, body, prompts: list[list[int]], params: SamplingParams, chat: bool):
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for k, ids in enumerate(prompts):
                streams.append(await self.engine.add_request(ids, params, f"{rid}-{k}"))
        except BaseException:
            for s in streams:
                s.abort()
            raise  # a RequestError becomes a 400
        run = Run(self, rid, body, params, streams, [len(p) for p in prompts], chat)
        if body.stream:
            return SSEResponse(run.events(), run.close, media_type="text/event-stream")
        collect = asyncio.ensure_future(run.collect())
        left = asyncio.ensure_future(_client_gone(request))
        try:
            await asyncio.wait({collect, left}, return_when=asyncio.FIRST_COMPLETED)
            if collect.done():
                return JSONResponse(collect.result())
            return Response(status_code=499)  # the client left: nobody to answer
        finally:
            for task in (collect, left):
                task.cancel()
            run.close()


async def _client_gone(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _describe(errors) -> str:
    """One line naming each bad field, from pydantic's error list."""
    parts = []
    for e in errors:
        if e.get("type") == "json_invalid":
            return f"malformed JSON body: {e.get('ctx', {}).get('error', e.get('msg'))}"
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")
        if e.get("type") == "extra_forbidden":  # every field is honoured or refused, never ignored
            parts.append(f"{loc}: unknown field, not supported by this server")
            continue
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return "invalid request: " + "; ".join(parts)
