"""The OpenAI-compatible HTTP app over an AsyncLLM: /v1/completions, /v1/chat/completions (JSON, or
server-sent events ending with `data: [DONE]`), /v1/responses (served as the chat request it means:
responses_api.py), /v1/models, /health, /metrics, and vLLM's tokenizer routes (tokenizer_routes.py).

Every request error is a 400 with an OpenAI error body (bad JSON, a wrong type, a parameter out of
range or over a ServerConfig limit, a prompt plus max_tokens over the context), except an unknown model
(404), a missing API key (401) and a body too large (413; guard.py); an unexpected failure is a 500
with the same shape, and the server keeps serving either way. A client that goes away — mid-stream, or
while waiting for a JSON answer — gets its requests aborted, which frees their KV blocks. A request the
engine fails alone (livemoe.engine.llm) ends with an error; the others go on. /health is 503 when the engine
loop died or its last step produced non-finite logits.

The engine may run in engine-core processes (AsyncLLM(engine_core="process"), several with data
parallelism): /health then says which replica died, and /metrics labels the engine's state per replica.
Requests while the engine sleeps, or when every core is dead, get a 503. The weight and memory routes
of rollout servers for RL (/update_weights_from_disk, /sleep, ...) are in admin.py.

The two generation routes are served on a lean path (hot_routes.py) with the same validation and handlers
as their FastAPI routes here, which answer whatever that path does not take (a body that does not validate).

Templates and tokenizers run on a small thread pool, off the event loop, so a long prompt does not
stall other streams or /health; a text that cannot fit the context is refused from its length alone.

A completions body with several prompts makes one engine request per prompt; choice k * n + j is
completion j of prompt k. The non-streaming `usage` carries an extension, `usage.metrics`: TTFT and
TPOT (seconds; the slowest request's TTFT, the token-weighted TPOT), output tokens and decode FLOPs;
a stream's usage event (`stream_options.include_usage`) carries it too.

About 400 lines: the OpenAI server's shared request handling (limits, tokenizing, answers and streams) and
its routes; the admin, live and hot routes are modules of their own.
"""
import asyncio
import dataclasses
import logging
from concurrent.futures import ThreadPoolExecutor
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse

from livemoe.engine.async_llm import AsyncLLM, RequestStream
from livemoe.engine.decoder.input_processor import tokenize_prompt
from livemoe.engine.errors import EngineDeadError, EngineSleepingError, GrammarCompileTimeout, RequestError
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.server.admin import add_admin_routes
from livemoe.engine.server.config import ServerConfig
from livemoe.engine.server.guard import RequestGuard
from livemoe.engine.server.hot_routes import HotRoutes
from livemoe.engine.server.live import live_router
from livemoe.engine.server.metrics import ServerMetrics
from livemoe.engine.server.openapi import document_errors
from livemoe.engine.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from livemoe.engine.server.responses import Run
from livemoe.engine.server.responses_api import ResponseShape, ResponsesRequest
from livemoe.engine.server.tokenizer_routes import tokenizer_router
from livemoe.engine.multimodal.chat import media_chat_prompt
from livemoe.engine.multimodal.media import split_media
from livemoe.engine.text.prompts import chat_prompt_ids
from livemoe.engine.text.reasoning import REASONING_PARSERS, think_token_ids

log = logging.getLogger("livemoe.engine.server")


INLINE_TOKENIZE_CHARS = 1024  # prompts (or token-id lists) up to this many items in all: tokenized on the loop


class ModelNotFound(RequestError):
    pass


def build_app(engine: AsyncLLM, model_name: str, config: ServerConfig | None = None,
              bind_host: str = "127.0.0.1", reasoning_parser: str | None = None, hot_routes: bool = True) -> FastAPI:
    """bind_host: where the server listens (loopback: only loopback Host names are answered by default).
    reasoning_parser: qwen3 or deepseek_r1 splits chat outputs' <think> blocks into reasoning_content.
    hot_routes: serve the two generation routes on the lean path (hot_routes.py); False: through FastAPI's
    routing alone (the same answers, at more CPU per request; the tests compare the two)."""
    config = ServerConfig() if config is None else config
    server = OpenAIServer(engine, model_name, config, reasoning_parser)
    docs = dict(openapi_url="/openapi.json", docs_url="/docs") if config.enable_docs else dict(openapi_url=None,
                                                                                                docs_url=None)
    app = GuardedApp(title="livemoe", redoc_url=None, **docs)
    app.state.server = server

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError):
        return JSONResponse(error_body(_describe(exc.errors())), status_code=400)

    @app.exception_handler(RequestError)
    @app.exception_handler(EngineSleepingError)
    @app.exception_handler(EngineDeadError)
    @app.exception_handler(Exception)
    async def request_failed(request: Request, exc: Exception):
        return error_response(exc, request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(error_body(str(exc.detail), kind="not_found_error" if exc.status_code == 404 else
                                       "invalid_request_error"), status_code=exc.status_code)

    @app.get("/health")
    async def health():
        errors = engine.replica_errors()
        if any(e is not None for e in errors):
            dead = {str(i): str(e) for i, e in enumerate(errors) if e is not None}
            return JSONResponse({"status": "dead", "error": "; ".join(dead.values()), "dead_replicas": dead},
                                status_code=503)
        if not all(s.get("last_logits_finite", True) for s in engine.replica_stats()):
            return JSONResponse({"status": "unhealthy", "error": "the model produced non-finite logits (NaN or "
                                 "inf) at its last step; its weights are likely broken"}, status_code=503)
        if engine.sleep_level:
            return JSONResponse({"status": "sleeping", "error": "the engine is asleep (POST /wake_up)"},
                                status_code=503)
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
        return await server.completions(body, request.receive)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        return await server.chat_completions(body, request.receive)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request):
        return await server.responses(body, request.receive)

    app.include_router(live_router(server))
    app.include_router(tokenizer_router(server))
    add_admin_routes(app, engine)
    document_errors(app)
    inner = app.fastapi_call
    if hot_routes:
        inner = HotRoutes(inner, server, on_error=error_response)
    app.front = RequestGuard(inner, config=config, host_names=config.host_names(bind_host))
    return app


class GuardedApp(FastAPI):
    """FastAPI behind `front`: the RequestGuard, then the hot routes, then FastAPI's own middleware stack and
    routes. In front of that stack rather than in it, the hot routes skip its layers too (error and
    telemetry middleware, each wrapping every event's send)."""

    front = None  # set by build_app

    async def __call__(self, scope, receive, send) -> None:
        try:
            await self.front(scope, receive, send)
        except Exception as exc:  # noqa: BLE001 (answered here, not raised to uvicorn)
            # Starlette's error middleware re-raises after sending its 500; raised to uvicorn, an exception closes
            # the connection that answer went out on, unannounced, and the client's next request on it fails.
            # (No wrapper around send to know whether an answer started: the server refuses a second start.)
            if scope["type"] != "http":
                raise
            path = scope.get("path", "")
            response = error_response(exc, path, quiet=True)
            try:
                await response(scope, receive, send)
            except RuntimeError:  # an answer had started (or was sent, and logged) already: nothing more to say
                log.debug("after its answer, %s raised %r", path, exc)
            else:
                if response.status_code == 500:
                    log.error("internal error on %s", path, exc_info=exc)

    async def fastapi_call(self, scope, receive, send) -> None:
        await super().__call__(scope, receive, send)


def error_response(exc: Exception, path: str, quiet: bool = False) -> JSONResponse:
    """The answer to a request that raised: 400 for a bad request (404 for an unknown model), 503 while the
    engine sleeps or is dead, else 500 (logged unless quiet). The FastAPI routes and the hot routes
    (hot_routes.py) both answer with it."""
    if isinstance(exc, ModelNotFound):  # as OpenAI and vLLM answer
        return JSONResponse(error_body(str(exc), "model_not_found"), status_code=404)
    if isinstance(exc, RequestError):
        return JSONResponse(error_body(str(exc)), status_code=400)
    if isinstance(exc, (EngineSleepingError, EngineDeadError)):
        return JSONResponse(error_body(str(exc), kind="service_unavailable"), status_code=503)
    if not quiet:
        log.error("internal error on %s", path, exc_info=exc)
    return JSONResponse(error_body(f"internal error: {exc!r}", kind="internal_error"), status_code=500)


class SSEResponse(StreamingResponse):
    """A StreamingResponse that always watches for the client leaving and always cleans up (closes its body
    iterator, then calls on_close), whatever the ASGI spec version of the server. The watch is one task
    that cancels the stream when the client's disconnect arrives (cheaper per request than the task group
    of Starlette's own; a write to a closed connection also ends the stream)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        streaming = asyncio.current_task()
        sent_all = False

        def client_left(watch: asyncio.Future) -> None:
            if not sent_all and not watch.cancelled():
                streaming.cancel()

        watch = asyncio.ensure_future(_client_gone(receive))
        watch.add_done_callback(client_left)
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for chunk in self.body_iterator:
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            sent_all = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except OSError:  # the client left while we were sending
            pass
        except asyncio.CancelledError:
            if not (watch.done() and not watch.cancelled()):
                raise  # cancelled from outside, not by the client leaving
            streaming.uncancel()
        finally:
            sent_all = True
            watch.cancel()
            await self.body_iterator.aclose()
            self.on_close()  # also when the client left before the body iterator ever started


class OpenAIServer:
    def __init__(self, engine: AsyncLLM, model_name: str, config: ServerConfig, reasoning_parser: str | None = None):
        if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"unknown reasoning parser {reasoning_parser!r}; choose one of {REASONING_PARSERS}")
        self.engine, self.model_name, self.tokenizer, self.config = engine, model_name, engine.tokenizer, config
        self.reasoning_parser = reasoning_parser
        self.think_tokens = None  # with a reasoning parser: (<think>, </think>) ids, when single tokens
        if reasoning_parser is not None and self.tokenizer is not None:
            self.think_tokens = think_token_ids(self.tokenizer)
        self.metrics = ServerMetrics(engine.replica_stats)
        self.created = int(time.time())
        self._token_text: dict[int, str] = {}
        # templates and tokenizers: off the event loop, on few threads (tokenizing is CPU work)
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="livemoe-tokenize")
        # no token stands for more characters than its vocabulary string has (byte-level: one per byte)
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()), default=1) if self.tokenizer else None

    # -- request preparation --------------------------------------------------------------------

    def check_model(self, name: str) -> None:
        if name != self.model_name:
            raise ModelNotFound(f"the model {name!r} does not exist; this server serves {self.model_name!r}")

    def check_available(self) -> None:
        """Asleep, or no engine core alive: 503 (EngineSleepingError / EngineDeadError)."""
        if self.engine.sleep_level:
            raise EngineSleepingError("the engine is asleep (POST /wake_up to wake it)")
        errors = self.engine.replica_errors()
        if all(e is not None for e in errors):
            raise EngineDeadError(f"the engine has stopped: {errors[0]}")

    @staticmethod
    def check_count(what: str, count: int, limit: int, flag: str) -> None:
        if count > limit:
            raise RequestError(f"{what}: {count} is over this server's limit of {limit} ({flag})")

    def check_limits(self, params: SamplingParams, prompts: list[list[int]]) -> None:
        """The server's bounds on one request's work (ServerConfig), and max_tokens against the context left
        after each prompt: refused, not clamped, when a prompt leaves less room (as vLLM does)."""
        c = self.config
        self.check_count("n", params.n, c.max_n, "--max-n")
        self.check_count("sequences (prompts x n)", len(prompts) * params.n, c.max_sequences, "--max-sequences")
        self.check_count("logprobs", params.logprobs or 0, c.max_logprobs, "--max-logprobs")
        self.check_count("prompt_logprobs", params.prompt_logprobs or 0, c.max_logprobs, "--max-logprobs")
        self.check_count("stop strings", len(params.stop), c.max_stop, "--max-stop")
        limit = self.context_limit
        for ids in prompts:
            if len(ids) + params.max_tokens > limit:
                raise RequestError(f"this model's maximum context length is {limit} tokens; the request asks for "
                                   f"{len(ids) + params.max_tokens} ({len(ids)} in the prompt, {params.max_tokens} "
                                   "in the completion): lower max_tokens")

    def check_text_fits(self, num_chars: int) -> None:
        """A text longer than the context times the longest token cannot fit: it is refused before it is
        tokenized (4 MB of text takes ~10 s of CPU, on the pool other requests tokenize on)."""
        if self.max_token_chars is None:
            return
        limit = self.context_limit
        if num_chars > limit * self.max_token_chars:
            raise RequestError(f"the prompt has {num_chars} characters; this model's maximum context length is "
                               f"{limit} tokens and no token is longer than {self.max_token_chars} characters, so "
                               f"at most {limit * self.max_token_chars} characters can fit")

    @property
    def context_limit(self) -> int:
        """Tokens one sequence may hold: the context, or the whole KV cache if smaller."""
        return self.engine.max_sequence_tokens()

    def room(self, ids: list[int]) -> int:
        """Tokens left to generate after this prompt (the default max_tokens; a prompt that leaves none is
        refused)."""
        limit = self.context_limit
        if len(ids) >= limit:
            raise RequestError(f"the prompt has {len(ids)} tokens; this model's maximum context length is {limit} "
                               "tokens, which leaves no room to generate")
        return limit - len(ids)

    async def off_loop(self, fn):
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn)

    async def tokenize(self, prompts: list) -> list[list[int]]:
        """The prompts' token ids: on the event loop when they are short (a tokenizer call on a few hundred
        characters costs less than the hop to a pool thread and back, which under a burst of requests
        queues behind the others and delays every add), else on the pool."""
        if sum(len(p) for p in prompts) <= INLINE_TOKENIZE_CHARS:
            return [self.encode(p) for p in prompts]
        return await self.off_loop(lambda: [self.encode(p) for p in prompts])

    def encode(self, prompt) -> list[int]:
        """Token ids as LLM.generate makes them (the engine's one tokenizing path)."""
        return tokenize_prompt(self.tokenizer, prompt)[1]

    def answer_only_constraint(self, params: SamplingParams) -> SamplingParams:
        """With a reasoning parser, a chat's output constraint applies to the answer after the think block
        (livemoe.engine.sampling.structured), as vLLM does; when </think> is not one token it applies to the whole output."""
        if params.structured is None or self.think_tokens is None:
            return params
        return dataclasses.replace(params, structured=dataclasses.replace(params.structured,
                                                                          think_tokens=self.think_tokens))

    async def compile_constraint(self, body) -> None:
        """Compiles the body's output constraint in a worker thread (cached; the engine loop then only
        looks it up); a bad schema, regex or grammar is a 400 naming the field."""
        found = body.constraint()
        if found is not None:
            budget = self.config.max_grammar_compile_s
            try:
                await self.off_loop(lambda: self.engine.compile_grammar(*found, timeout_s=budget))
            except GrammarCompileTimeout as e:
                raise RequestError(f"{e} (this server's budget: --max-grammar-compile-s {budget:g})") from None

    def token_text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else f"<{token_id}>"
            self._token_text[token_id] = text
        return text

    # -- the generation routes ------------------------------------------------------------------

    async def completions(self, body: CompletionRequest, receive):
        """POST /v1/completions with a validated body; receive: the request's ASGI receive (a client that
        leaves is noticed on it)."""
        self.check_model(body.model)
        self.check_available()
        texts = body.prompts()
        self.check_count("prompts", len(texts), self.config.max_prompts, "--max-prompts")
        for p in texts:
            self.check_text_fits(len(p) if isinstance(p, str) else 0)
        prompts = await self.tokenize(texts)
        params = body.sampling_params(room=min(self.room(ids) for ids in prompts))
        self.check_limits(params, prompts)
        await self.compile_constraint(body)
        return await self.respond(receive, body, prompts, params, chat=False)

    async def chat_completions(self, body: ChatCompletionRequest, receive):
        """POST /v1/chat/completions with a validated body (as completions)."""
        ids, params = await self.prepare_chat(body)
        return await self.respond(receive, body, [ids], params, chat=True)

    async def responses(self, body: ResponsesRequest, receive):
        """POST /v1/responses: served as the chat request it means (responses_api.py)."""
        chat = body.as_chat()
        ids, params = await self.prepare_chat(chat)
        def count(text: str) -> int:  # the reasoning tokens in usage
            return len(self.tokenizer.encode(text, add_special_tokens=False)) if self.tokenizer is not None else 0

        return await self.respond(receive, chat, [ids], params, chat=True,
                                  shape=lambda run: ResponseShape(run, body, count))

    async def prepare_chat(self, body: ChatCompletionRequest) -> tuple[list[int], SamplingParams]:
        """A chat body's prompt ids and sampling params, checked against the server's limits, its constraint
        compiled."""
        self.check_model(body.model)
        self.check_available()
        messages = [m.as_template_input() for m in body.messages]
        self.check_text_fits(sum(len(m["content"]) if isinstance(m["content"], str)
                                 else sum(len(p.get("text", "")) for p in m["content"]) for m in messages))
        # the template renders the tools (Qwen3's lists them in the system turn)
        tools = [{"type": "function", "function": f} for f in body.tool_functions()] \
            if body.tool_mode() != "none" else None
        if any(isinstance(m["content"], list) for m in messages):  # media parts: decoded off the loop
            processor = self.engine.media_processor
            ids = await self.off_loop(lambda: media_chat_prompt(
                self.tokenizer, messages, processor, self.config.allowed_local_media_path,
                body.special_tokens_in_content, tools))
        else:
            ids = await self.off_loop(lambda: chat_prompt_ids(self.tokenizer, messages,
                                                              body.special_tokens_in_content, tools))
        params = self.answer_only_constraint(body.sampling_params(room=self.room(ids)))
        self.check_limits(params, [ids])
        await self.compile_constraint(body)
        return ids, params

    # -- running --------------------------------------------------------------------------------

    async def respond(self, receive, body, prompts: list[list[int]], params: SamplingParams, chat: bool,
                      shape=None):
        """shape(run): the answer's shape when not the endpoint's own (Run's: completions or chat), with the
        same collect() and events()."""
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        streams: list[RequestStream] = []
        try:
            for k, ids in enumerate(prompts):
                streams.append(await self.engine.add_request(ids, params, f"{rid}-{k}"))
        except BaseException:
            for s in streams:
                s.abort()
            raise  # a RequestError becomes a 400
        run = Run(self, rid, body, params, streams, [split_media(p)[0] for p in prompts], chat)
        answer = run if shape is None else shape(run)
        if body.stream:
            return SSEResponse(answer.events(), run.close, media_type="text/event-stream")
        collect = asyncio.ensure_future(answer.collect())
        left = asyncio.ensure_future(_client_gone(receive))
        try:
            await asyncio.wait({collect, left}, return_when=asyncio.FIRST_COMPLETED)
            if collect.done():
                return JSONResponse(collect.result())
            return Response(status_code=499)  # the client left: nobody to answer
        finally:
            for task in (collect, left):
                task.cancel()
            run.close()


async def _client_gone(receive) -> None:
    while (await receive())["type"] != "http.disconnect":
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
