"""One HTTP request's engine requests turned into the OpenAI answer: a JSON body (`Run.collect`) or the
server-sent events of a stream (`Run.events`), with usage (on every chunk too with vLLM's
`stream_options.continuous_usage_stats`), logprobs in each endpoint's format, and the per-request metrics (the
server's Prometheus metrics and log line) as each engine request finishes.

Prompt logprobs come in two shapes: completions' `echo` with `logprobs` puts the prompt tokens before the output's
in OpenAI's legacy lists (the first token's logprob and top_logprobs null), and vLLM's `prompt_logprobs` is a list
per prompt of None then {token id: {logprob, rank, decoded_token}} (on each completions choice; once per chat
answer). rank is the order among the returned top-N; the prompt token's own is null when it is not among them.
"""
import asyncio
import time
from typing import Any, Protocol

import msgspec

from livemoe.engine import routed_experts
from livemoe.engine.async_llm import RequestStream
from livemoe.engine.errors import EngineError
from livemoe.engine.outputs import RequestMetrics
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.server.chat_output import ChoiceParser
from livemoe.engine.server.protocol import error_body
from livemoe.engine.text.streaming import StreamDelta, merge_deltas

class Server(Protocol):
    """What a Run reads of the server (livemoe.engine.server.app.OpenAIServer), which imports this module."""

    model_name: str
    tokenizer: Any
    reasoning_parser: str | None
    metrics: Any

    def token_text(self, token_id: int) -> str: ...

LOGPROB_FLOOR = -9999.0  # JSON has no -inf (a token filtered out in "processed" mode)


class Choice:
    """One choice being assembled for a non-streaming answer."""

    def __init__(self):
        self.text: list[str] = []
        self.token_ids: list[int] = []
        self.logprobs: list[dict] = []
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.routed_experts = None
        self.weight_versions: list = []


class Run:
    """The engine requests of one HTTP request, turned into an OpenAI answer or event stream."""

    def __init__(self, server: Server, rid: str, body, params: SamplingParams, streams: list[RequestStream],
                 prompts: list[list[int]], chat: bool):
        self.server, self.rid, self.body, self.params, self.streams = server, rid, body, params, streams
        self.prompts, self.prompt_lens, self.chat = prompts, [len(p) for p in prompts], chat
        self.prompt_logprobs: dict[int, list] = {}  # prompt index -> the engine's prompt logprobs (when asked)
        self.n = params.n
        self.created = int(time.time())
        self.num_output_tokens = 0
        self.finished_metrics: dict[int, RequestMetrics] = {}
        self.reasons: dict[int, dict[int, str]] = {k: {} for k in range(len(streams))}
        self.text_offsets: dict[int, int] = {}
        self.closed = False
        # chat: reasoning content and tool calls split off each choice's text (inactive: plain content)
        tools = chat and body.tool_mode() != "none"
        legacy = chat and body.legacy_functions
        self.parsers = [ChoiceParser(server.reasoning_parser if chat else None, tools, legacy)
                        for _ in range(len(streams) * self.n)]
        # completions with echo: each choice's text starts with its prompt's
        self.echo = [p if isinstance(p, str) else server.tokenizer.decode(p) if server.tokenizer is not None else ""
                     for p in body.prompts()] if getattr(body, "echo", False) else None
        if self.echo:  # the output's text offsets follow the echoed prompt's
            self.text_offsets = {i: len(self.echo[i // self.n]) for i in range(len(streams) * self.n)}

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
        if d.prompt_logprobs is not None:
            self.prompt_logprobs[k] = d.prompt_logprobs
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
            if d.weight_versions is not None:
                c.weight_versions += d.weight_versions
            if d.finish_reason is not None:
                c.finish_reason, c.stop_reason, c.routed_experts = d.finish_reason, d.stop_reason, d.routed_experts
        out = []
        for i, c in enumerate(choices):
            text = "".join(c.text)
            choice = {"index": i}
            parser = self.parsers[i]
            if parser.active:
                choice["message"] = parser.message(text)
            elif self.chat:
                choice["message"] = {"role": "assistant", "content": text}
            else:
                choice["text"] = (self.echo[i // self.n] if self.echo else "") + text
            choice["logprobs"] = None
            if self.params.logprobs is not None:
                parts = c.logprobs
                if self.echo and not self.chat:  # echo with logprobs: the prompt's tokens lead
                    parts = [self._echo_logprobs(i // self.n), *parts]
                choice["logprobs"] = _merge_logprobs(parts, self.chat)
            if not self.chat and self.body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = self._vllm_prompt_logprobs(i // self.n)
            choice["finish_reason"] = parser.finish_reason(c.finish_reason)
            choice["stop_reason"] = c.stop_reason
            if self.body.return_token_ids:
                choice["token_ids"] = c.token_ids
            if self.params.return_routed_experts:
                choice["routed_experts"] = _routed(c.routed_experts)
            if self.params.return_weight_versions:
                choice["weight_versions"] = c.weight_versions
            out.append(choice)
        answer = {"id": self.rid, "object": "chat.completion" if self.chat else "text_completion",
                  "created": self.created, "model": self.server.model_name, "choices": out, "usage": self._usage()}
        if self.chat and self.body.prompt_logprobs is not None:
            answer["prompt_logprobs"] = self._vllm_prompt_logprobs(0)
        return answer

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

    def _event(self, choices: list[dict], usage="absent") -> bytes:
        chunk = {"id": self.rid, "object": "chat.completion.chunk" if self.chat else "text_completion",
                 "created": self.created, "model": self.server.model_name, "choices": choices}
        if usage == "absent" and self.body.continuous_usage:
            usage = self._usage()
        if self.body.include_usage or self.body.continuous_usage:
            chunk["usage"] = None if usage == "absent" else usage
        return _sse(chunk)

    async def events(self):
        try:
            if self.chat:
                for i in range(len(self.streams) * self.n):
                    yield self._event([{"index": i, "delta": {"role": "assistant", "content": ""},
                                        "logprobs": None, "finish_reason": None}])
            elif self.echo:
                for i in range(len(self.streams) * self.n):
                    yield self._event([{"index": i, "text": self.echo[i // self.n], "logprobs": None,
                                        "finish_reason": None}])
            async for k, d in self.deltas():
                i = k * self.n + d.index
                choice = {"index": i}
                parser = self.parsers[i]
                if parser.active:
                    choice["delta"] = parser.feed(d.text, last=d.finish_reason is not None)
                else:
                    choice.update({"delta": {"content": d.text}} if self.chat else {"text": d.text})
                choice["logprobs"] = (_merge_logprobs([self._logprobs(i, d)], self.chat)
                                      if d.logprobs is not None else None)
                choice["finish_reason"] = parser.finish_reason(d.finish_reason)
                if d.finish_reason is not None:
                    choice["stop_reason"] = d.stop_reason
                if self.body.return_token_ids:
                    choice["token_ids"] = d.token_ids
                if self.params.return_routed_experts and d.finish_reason is not None:
                    choice["routed_experts"] = _routed(d.routed_experts)
                if self.params.return_weight_versions:
                    choice["weight_versions"] = d.weight_versions or []
                yield self._event([choice])
            if self.body.include_usage:
                yield self._event([], self._usage())
        except EngineError as e:
            yield _sse(error_body(str(e), kind="internal_error"))
        yield b"data: [DONE]\n\n"

    # -- logprobs -------------------------------------------------------------------------------

    def _echo_logprobs(self, k: int) -> dict:
        """Prompt k's tokens in the completions logprobs format; the choice's output offsets follow them."""
        text, top = self.server.token_text, self.params.logprobs
        ids, lps = self.prompts[k], self.prompt_logprobs[k]
        tokens = [text(t) for t in ids]
        offsets = [0]
        for s in tokens[:-1]:
            offsets.append(offsets[-1] + len(s))
        return {"tokens": tokens,
                "token_logprobs": [None if lp is None else _finite(lp[t]) for t, lp in zip(ids, lps)],
                "top_logprobs": [None if lp is None else {text(x): _finite(v) for x, v in _top(lp, top)}
                                 for lp in lps],
                "text_offset": offsets}

    def _vllm_prompt_logprobs(self, k: int) -> list:
        text, top = self.server.token_text, self.body.prompt_logprobs
        out: list[dict | None] = []
        for t, lp in zip(self.prompts[k], self.prompt_logprobs[k]):
            if lp is None:
                out.append(None)
                continue
            ranked = _top(lp, top)
            entry = {str(x): {"logprob": _finite(v), "rank": r, "decoded_token": text(x)}
                     for r, (x, v) in enumerate(ranked, 1)}
            entry.setdefault(str(t), {"logprob": _finite(lp[t]), "rank": None, "decoded_token": text(t)})
            out.append(entry)
        return out

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


_json = msgspec.json.Encoder()  # compact UTF-8 JSON, several times faster than the stdlib's per chunk


def _sse(obj) -> bytes:
    return b"data: " + _json.encode(obj) + b"\n\n"


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


def _routed(ids) -> dict | None:
    """A finished choice's routed experts as JSON (None where the engine ended it without them, an abort)."""
    return None if ids is None else routed_experts.encode(ids)
