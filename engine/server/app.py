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
import json
import logging
import time
import uuid

import anyio
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import StreamingResponse

from engine.async_llm import AsyncLLM, EngineError, RequestStream
from engine.outputs import RequestMetrics
from engine.sampling import RequestError, SamplingParams
from engine.server.metrics import ServerMetrics
from engine.server.protocol import ChatCompletionRequest, CompletionRequest, error_body
from engine.streaming import StreamDelta, merge_deltas

log = logging.getLogger("engine.serve")
LOGPROB_FLOOR = -9999.0  # JSON has no -inf (a token filtered out in "processed" mode)


class ModelNotFound(RequestError):
    pass


def build_app(engine: AsyncLLM, model_name: str) -> FastAPI:
    server = OpenAIServer(engine, model_name)
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
        prompts = [server.encode(p) for p in body.prompts()]
        return await server.respond(request, body, prompts, params, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        server.check_model(body.model)
        ids = server.encode(server.apply_chat_template([m.as_template_input() for m in body.messages]),
                            add_special_tokens=False)
        params = body.sampling_params(room=max(1, server.context_limit - len(ids)))
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


class Choice:
    """One choice being assembled for a non-streaming answer."""

    def __init__(self):
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None


class OpenAIServer:
    def __init__(self, engine: AsyncLLM, model_name: str):
        self.engine, self.model_name, self.tokenizer = engine, model_name, engine.tokenizer
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

    def apply_chat_template(self, messages: list[dict]) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise RequestError("this model has no chat template; use /v1/completions")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception as e:  # the template's own checks (e.g. role order) raise jinja errors
            raise RequestError(f"the chat template rejected the messages: {e}") from None

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


class Run:
    """The engine requests of one HTTP request, turned into an OpenAI answer or event stream."""

    def __init__(self, server: OpenAIServer, rid: str, body, params: SamplingParams, streams: list[RequestStream],
                 prompt_lens: list[int], chat: bool):
        self.server, self.rid, self.body, self.params, self.streams = server, rid, body, params, streams
        self.prompt_lens, self.chat = prompt_lens, chat
        self.n = params.n
        self.created = int(time.time())
        self.num_output_tokens = 0
        self.finished_metrics: dict[int, RequestMetrics] = {}
        self.reasons: dict[int, dict[int, str]] = {k: {} for k in range(len(streams))}
        self.text_offsets: dict[int, int] = {}
        self.closed = False

    async def deltas(self):
        """(prompt index, delta) pairs from all streams as they come; aborts what is left on exit. When
        the server falls behind the engine, the deltas that piled up go out merged: fewer, larger
        events instead of a growing backlog."""
        pending = {}
        try:
            if len(self.streams) == 1:  # the common case, without a task per delta
                stream = self.streams[0]
                async for delta in stream:
                    for d in merge_deltas([delta] + stream.take_ready()):
                        self._account(0, d)
                        yield 0, d
                return
            pending = {asyncio.ensure_future(s.__anext__()): k for k, s in enumerate(self.streams)}
            while pending:
                done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for fut in done:
                    k = pending.pop(fut)
                    try:
                        delta = fut.result()
                    except StopAsyncIteration:
                        continue
                    merged = merge_deltas([delta] + self.streams[k].take_ready())
                    pending[asyncio.ensure_future(self.streams[k].__anext__())] = k
                    for d in merged:
                        self._account(k, d)
                        yield k, d
        finally:
            for fut in pending:
                fut.cancel()
            self.close()

    def close(self) -> None:
        """Aborts the engine requests that have not finished (once; later calls do nothing)."""
        if self.closed:
            return
        self.closed = True
        for k, s in enumerate(self.streams):
            s.abort()
            if k not in self.finished_metrics:
                self.server.metrics.request_aborted(f"{self.rid}-{k}", self.n - len(self.reasons[k]),
                                                    "the client left or the engine stopped")

    def _account(self, k: int, d: StreamDelta) -> None:
        self.num_output_tokens += len(d.token_ids)
        if d.finish_reason is not None:
            self.reasons[k][d.index] = d.finish_reason
        if d.metrics is not None:
            self.finished_metrics[k] = d.metrics
            reasons = [self.reasons[k][j] for j in sorted(self.reasons[k])]
            self.server.metrics.request_finished(f"{self.rid}-{k}", reasons, d.metrics)

    # -- JSON answer ----------------------------------------------------------------------------

    async def collect(self) -> dict:
        choices = [Choice() for _ in range(len(self.streams) * self.n)]
        async for k, d in self.deltas():
            c = choices[k * self.n + d.index]
            c.text.append(d.text)
            c.token_ids += d.token_ids
            if d.logprobs is not None:
                c.logprobs.append(self._logprobs(k * self.n + d.index, d))
            if d.finish_reason is not None:
                c.finish_reason, c.stop_reason = d.finish_reason, d.stop_reason
        out = []
        for i, c in enumerate(choices):
            text = "".join(c.text)
            choice = {"index": i}
            choice.update({"message": {"role": "assistant", "content": text}} if self.chat else {"text": text})
            choice["logprobs"] = _merge_logprobs(c.logprobs, self.chat) if self.params.logprobs is not None else None
            choice["finish_reason"] = c.finish_reason
            choice["stop_reason"] = c.stop_reason
            if self.body.return_token_ids:
                choice["token_ids"] = c.token_ids
            out.append(choice)
        return {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                "created": self.created, "model": self.server.model_name, "choices": out,
                "usage": self._usage()}

    def _usage(self) -> dict:
        prompt = sum(self.prompt_lens)
        ms = list(self.finished_metrics.values())
        usage = {"prompt_tokens": prompt, "completion_tokens": self.num_output_tokens,
                 "total_tokens": prompt + self.num_output_tokens,
                 "prompt_tokens_details": {"cached_tokens": sum(m.num_cached_tokens for m in ms)}}
        if ms:
            ttfts = [m.ttft for m in ms if m.ttft is not None]
            spans = [(m.tpot, m.num_output_tokens - self.n) for m in ms if m.tpot is not None]
            weight = sum(w for _, w in spans)
            usage["metrics"] = {
                "ttft_s": max(ttfts) if ttfts else None,
                "tpot_s": sum(t * w for t, w in spans) / weight if weight > 0 else None,
                "output_tokens": sum(m.num_output_tokens for m in ms),
                "decode_flops": sum(m.decode_flops for m in ms),
            }
        return usage

    # -- event stream ---------------------------------------------------------------------------

    def _event(self, choices: list[dict], usage="absent") -> str:
        chunk = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.server.model_name, "choices": choices}
        if self.body.include_usage:
            chunk["usage"] = None if usage == "absent" else usage
        return f"data: {json.dumps(chunk, separators=(',', ':'), ensure_ascii=False)}\n\n"

    async def events(self):
        try:
            if self.chat:
                for i in range(len(self.streams) * self.n):
                    yield self._event([{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}])
            async for k, d in self.deltas():
                i = k * self.n + d.index
                choice = {"index": i}
                choice.update({"delta": {"content": d.text}} if self.chat else {"text": d.text})
                choice["logprobs"] = (_merge_logprobs([self._logprobs(i, d)], self.chat)
                                      if d.logprobs is not None else None)
                choice["finish_reason"] = d.finish_reason
                if d.finish_reason is not None:
                    choice["stop_reason"] = d.stop_reason
                if self.body.return_token_ids:
                    choice["token_ids"] = d.token_ids
                yield self._event([choice])
            if self.body.include_usage:
                yield self._event([], self._usage())
        except EngineError as e:
            yield f"data: {json.dumps(error_body(str(e), kind='internal_error'))}\n\n"
        yield "data: [DONE]\n\n"

    # -- logprobs -------------------------------------------------------------------------------

    def _logprobs(self, i: int, d: StreamDelta) -> dict:
        """This delta's logprobs in the endpoint's format (merged across deltas by _merge_logprobs)."""
        k = self.params.logprobs
        text = self.server.token_text
        if self.chat:
            def entry(t, v):
                s = text(t)
                return {"token": s, "logprob": _finite(v), "bytes": list(s.encode())}

            return {"content": [{**entry(t, lp[t]), "top_logprobs": [entry(x, v) for x, v in _top(lp, k)]}
                                for t, lp in zip(d.token_ids, d.logprobs)]}
        offset = self.text_offsets.get(i, 0)
        tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
        for t, lp in zip(d.token_ids, d.logprobs):
            s = text(t)
            tokens.append(s)
            token_logprobs.append(_finite(lp[t]))
            top_logprobs.append({text(x): _finite(v) for x, v in _top(lp, k)})
            offsets.append(offset)
            offset += len(s)
        self.text_offsets[i] = offset
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
                "text_offset": offsets}


def _top(lp: dict[int, float], k: int) -> list[tuple[int, float]]:
    """The k most likely tokens of one position (the engine's dict holds the sampled token and the top k)."""
    return sorted(lp.items(), key=lambda kv: -kv[1])[:k] if k else []


def _finite(v: float) -> float:
    return max(float(v), LOGPROB_FLOOR)


def _merge_logprobs(parts: list[dict], chat: bool) -> dict:
    if chat:
        return {"content": [c for p in parts for c in p["content"]]}
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    return {key: [x for p in parts for x in p[key]] for key in keys}


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
        parts.append(f"{loc or 'body'}: {e.get('msg')}")
    return "invalid request: " + "; ".join(parts)
