"""Streaming: the decoder's cumulative RequestOutputs turned into per-step deltas.

    for delta in stream(llm, "Hello", SamplingParams(max_tokens=32)):   # also llm.stream(...)
        print(delta.text, end="", flush=True)

A delta carries one completion's new token ids (and their logprobs) and the new text, and is yielded
right after the step that made them: the first token goes out as soon as it exists. Text goes through
an IncrementalDetokenizer (UTF-8 safe; stop strings never leak), and the last delta of a completion
brings its text up to exactly the non-streaming `CompletionOutput.text`, so the deltas joined equal it.
Closing the generator early (break, `close()`, an exception in the caller) aborts the request, which
frees its KV blocks.

`OutputDeltas` is the converter alone; `AsyncLLM` uses it on the outputs of its engine loop.
"""
from dataclasses import dataclass
from typing import Any

from livemoe.engine.errors import RequestFailedError
from livemoe.engine.outputs import RequestMetrics, RequestOutput
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.text.detokenizer import IncrementalDetokenizer


@dataclass
class StreamDelta:
    request_id: str
    index: int  # which of the request's n completions
    token_ids: list[int]  # new since this completion's previous delta
    text: str  # new text (may be empty while a character is incomplete)
    logprobs: list[dict[int, float]] | None = None  # one dict per new token, as in CompletionOutput
    finish_reason: str | None = None  # set on the completion's last delta
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    metrics: RequestMetrics | None = None  # on the request's last delta (every completion finished)
    prompt_logprobs: list[dict[int, float] | None] | None = None  # once, as in RequestOutput, when asked
    routed_experts: Any = None  # return_routed_experts: on the completion's last delta (CompletionOutput's)
    weight_versions: list | None = None  # return_weight_versions: one per new token, as in CompletionOutput

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputDeltas:
    """Feeds the cumulative RequestOutputs of one request; returns the deltas they add."""

    def __init__(self, tokenizer, params: SamplingParams):
        self.params = params
        self.detoks: dict[int, IncrementalDetokenizer] = {}
        self.sent: dict[int, int] = {}  # completion index -> tokens already sent
        self.done: set[int] = set()
        self.tokenizer = tokenizer
        self.prompt_logprobs_sent = False

    def feed(self, out: RequestOutput) -> list[StreamDelta]:
        deltas = []
        for c in out.outputs:
            if c.index in self.done:
                continue
            detok = self.detoks.get(c.index)
            if detok is None:
                detok = self.detoks[c.index] = IncrementalDetokenizer(
                    self.tokenizer, self.params.skip_special_tokens, self.params.stop)
            start = self.sent.get(c.index, 0)
            new_ids = c.token_ids[start:]
            if not new_ids and c.finish_reason is None:
                continue
            self.sent[c.index] = len(c.token_ids)
            if c.finish_reason is None:
                text = detok.push(new_ids)
            else:  # the engine's text is the truth (a stop string cut, a stop token left out)
                text = detok.finish(c.text, new_ids)
                self.done.add(c.index)
            lps = c.logprobs[start:start + len(new_ids)] if c.logprobs is not None else None
            versions = c.weight_versions[start:start + len(new_ids)] if c.weight_versions is not None else None
            deltas.append(StreamDelta(out.request_id, c.index, new_ids, text, lps, c.finish_reason, c.stop_reason,
                                      len(out.prompt_token_ids), routed_experts=c.routed_experts,
                                      weight_versions=versions))
        if out.finished and deltas:
            deltas[-1].metrics = out.metrics
        if out.prompt_logprobs is not None and deltas and not self.prompt_logprobs_sent:
            deltas[0].prompt_logprobs, self.prompt_logprobs_sent = out.prompt_logprobs, True
        return deltas


def merge_deltas(deltas: list[StreamDelta]) -> list[StreamDelta]:
    """Consecutive deltas of one request as one delta per completion (tokens, text and logprobs joined,
    the last finish reason kept; the request's metrics on the last delta returned)."""
    merged: dict[int, StreamDelta] = {}
    metrics = prompt_logprobs = None
    for d in deltas:
        metrics = d.metrics or metrics
        prompt_logprobs = prompt_logprobs or d.prompt_logprobs
        m = merged.get(d.index)
        if m is None:
            merged[d.index] = StreamDelta(d.request_id, d.index, list(d.token_ids), d.text,
                                          None if d.logprobs is None else list(d.logprobs), d.finish_reason,
                                          d.stop_reason, d.num_prompt_tokens, routed_experts=d.routed_experts,
                                          weight_versions=None if d.weight_versions is None
                                          else list(d.weight_versions))
            continue
        assert m.finish_reason is None, "a delta after its completion's last one"
        m.token_ids += d.token_ids
        m.text += d.text
        if d.logprobs is not None:
            m.logprobs += d.logprobs
        if d.weight_versions is not None:
            m.weight_versions = (m.weight_versions or []) + d.weight_versions
        m.finish_reason, m.stop_reason, m.routed_experts = d.finish_reason, d.stop_reason, d.routed_experts
    out = list(merged.values())
    if out:
        out[-1].metrics = metrics
        out[0].prompt_logprobs = prompt_logprobs
    return out


def stream(llm, prompt, params: SamplingParams | None = None, request_id: str | None = None):
    """Yields StreamDeltas of one request while driving `llm.step()` (the caller's thread is the engine
    loop: other requests in the engine advance too, and their finished outputs are kept for the next
    step() as generate() does). `LLM.stream(prompt, params)` calls it."""
    params = SamplingParams() if params is None else params
    # added (and validated: a bad request raises RequestError) at the first next(), so a generator that
    # is never iterated leaves nothing queued in the engine
    request_id = llm.add_request(prompt, params, request_id)
    deltas = OutputDeltas(llm.tokenizer, params)
    finished = False
    try:
        while not finished:
            for out in llm.step():
                if out.request_id != request_id:
                    if out.finished:
                        llm.core.pending.append(out)  # someone else's: the next step() returns it
                    continue
                finished = out.finished
                yield from deltas.feed(out)
            if not finished and request_id not in llm.core.requests:
                why = llm.core.failed.pop(request_id, None)
                if why is not None:  # the engine ended it (a fault of this request alone)
                    raise RequestFailedError(f"the engine ended request {request_id}: {why}")
                return  # aborted from elsewhere
    finally:
        if not finished:
            llm.abort(request_id)
