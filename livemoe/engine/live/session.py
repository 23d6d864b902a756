"""LiveSession: a long-lived request that decides OBS / MEM / ANS at each interval of a live stream.

    session = LiveSession(llm, system="you are the live assistant of ...", interval_s=10)
    d = session.step([{"type": "comment", "user": "amy", "text": "how much is link 3?"}])
    d.kind, d.recipient, d.task, d.message, d.metrics.cached_prompt_tokens

Each step appends the interval's events (livemoe.engine.live.layout) to the session's context and decodes one
decision held to the decision grammar (livemoe.engine.live.decision: a regex, through the engine's structured
output), so it always parses whatever the weights. The session's KV blocks stay in the cache between
intervals: when its request finishes, the block manager pins them for the session (up to its pin
budget, `BlockManager.max_pinned_blocks`), and the next step's prompt, the same tokens followed by the
new ones, takes them back from the prefix cache, partial last block included: a step prefills only
the end token of the previous decision and the new events.

Long streams: when the next step would pass `max_context` tokens, the context is compacted to the
system prompt, the MEM notes (the session's memory) and the most recent intervals that fit, and
re-prefilled; the decision's metrics say so and count what it cost. The notes take at most half of
what the system prompt leaves; past that the oldest are dropped and counted (`num_dropped_notes`).

`step_sessions(llm, [(session, events), ...])` decides several sessions in one batch (with whatever
else the engine is running); `LiveSession.step` is that with one.

A session made on an AsyncLLM (the server's, whichever engine core: a thread or its own process) steps with
`await session.astep(engine, events)`: its requests carry the session's id as their pin key, so the engine core
that serves them keeps the blocks pinned (livemoe.engine.core.service), and `close()` gives them back there.
"""
import asyncio
import time
from itertools import count

from livemoe.engine.async_llm import AsyncLLM
from livemoe.engine.errors import DecisionFormatError, RequestError
from livemoe.engine.live.decision import (MAX_MESSAGE_CHARS, TASKS, Decision, decision_regex, max_decision_chars,
                                          parse_decision)
from livemoe.engine.live.layout import encode, interval_segment, memory_segment, render_events, system_segment
from livemoe.engine.live.media import interval_ids, media_events
from livemoe.engine.multimodal.media import MultimodalPrompt, split_media
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.sampling.structured import StructuredOutput

_ids = count()


class LiveSession:
    def __init__(self, llm, system: str, *, interval_s: float = 10.0, tasks=TASKS,
                 max_message_chars: int = MAX_MESSAGE_CHARS, max_context: int | None = None,
                 keep_intervals: int = 4, temperature: float = 0.0, seed: int | None = None,
                 session_id: str | None = None, local_media_root: str | None = "/"):
        """llm: an LLM (step, or astep through an AsyncLLM over it), or an AsyncLLM (astep only; any engine core).
        local_media_root: where `audio` / `video` events may name files (None: nowhere; the server's
        --allowed-local-media-path for its sessions)."""
        if llm.tokenizer is None:
            raise RequestError("a live session needs a tokenizer, and this checkpoint has none")
        if not isinstance(system, str) or not system.strip():
            raise RequestError("system must be a non-empty string")
        if not interval_s > 0:
            raise RequestError(f"interval_s must be > 0, got {interval_s!r}")
        if not isinstance(keep_intervals, int) or keep_intervals < 0:
            raise RequestError(f"keep_intervals must be an integer >= 0, got {keep_intervals!r}")
        self.llm, self.system, self.interval_s = llm, system, interval_s
        self.tasks = tuple(tasks)
        self.id = session_id or f"live-{next(_ids)}"
        if max_context is not None and (not isinstance(max_context, int) or max_context < 1):
            raise RequestError(f"max_context must be a positive integer, got {max_context!r}")
        self.max_context = max_context or llm.max_model_len
        if self.max_context > llm.max_model_len:
            raise RequestError(f"max_context {self.max_context} exceeds the engine's max_model_len {llm.max_model_len}")
        self.keep_intervals = keep_intervals
        self.params = SamplingParams(temperature=temperature, seed=seed,
                                     max_tokens=max_decision_chars(self.tasks, max_message_chars) + 1,
                                     **decision_constraint(self.tasks, max_message_chars))
        tok = llm.tokenizer
        self.eos_token_ids = frozenset(llm.eos_token_ids)
        self.end_id = tok.eos_token_id if tok.eos_token_id is not None else min(self.eos_token_ids)
        self.system_ids = encode(tok, system_segment(system))
        # the least a step needs: the system prompt, an interval with no events, a decision's budget
        least = (len(self.system_ids) + len(encode(tok, interval_segment(render_events([], 0.0), False)))
                 + self.params.max_tokens)
        if least > self.max_context:
            raise RequestError(f"max_context {self.max_context} is too small: a step needs at least {least} tokens "
                               f"(the system prompt's {len(self.system_ids)}, an interval's header and a decision's "
                               f"{self.params.max_tokens} with max_message_chars {max_message_chars})")
        self.ids: list = list(self.system_ids)  # the context as the model has it (what the next step extends)
        self.records: list = []  # per interval: (events text, decision token ids with the end token)
        self.notes: list = []  # MEM notes: the session's memory, kept through compactions
        self.media: list = []  # PlacedMedia in self.ids (audio / video events since the last compaction)
        self.local_media_root = local_media_root
        self.pin = None  # livemoe.engine.decoder.block_manager.Pin of the blocks kept between steps (set by the block manager)
        self.num_compactions = 0
        self.num_dropped_notes = 0  # MEM notes a compaction had no room for (the oldest)
        self.closed = False
        self.last_used = time.monotonic()

    @property
    def num_intervals(self) -> int:
        return len(self.records)

    @property
    def on_async_engine(self) -> bool:
        """Made on an AsyncLLM: its blocks are pinned by the engine core (astep only)."""
        return isinstance(self.llm, AsyncLLM)

    def step(self, events, t: float | None = None) -> Decision:
        """Decides one interval. t: its time in seconds (default: the session's clock, interval_s apart)."""
        if self.on_async_engine:
            raise RequestError("this session was made on an AsyncLLM: await session.astep(engine, events)")
        return step_sessions(self.llm, [(self, events, t)])[0]

    async def astep(self, engine, events, t: float | None = None) -> Decision:
        """step() through an AsyncLLM: the one this session was made on, or one over its LLM. The caller runs
        one step of a session at a time."""
        t0 = time.perf_counter()
        if self.on_async_engine:
            assert engine is self.llm, "the session belongs to another engine"
            # tokenizing a large interval takes seconds: off the event loop
            text, prompt, compacted = await asyncio.to_thread(self._prepare, events, t)
            ids, parts, metrics = [], [], None
            async for delta in engine.generate(prompt, self.params, request_id=self._request_id(), pin_key=self.id):
                ids += delta.token_ids
                parts.append(delta.text)
                metrics = delta.metrics or metrics
            return self._finish(text, prompt, ids, "".join(parts), metrics, compacted, time.perf_counter() - t0)
        assert engine.llm is self.llm, "the session belongs to another engine"
        text, prompt, compacted = self._prepare(events, t)
        rid = self._request_id()
        bm = self.llm.core.block_manager
        bm.pin_on_finish(rid, self)  # a dict entry the engine thread reads when the request finishes
        ids, parts, metrics = [], [], None
        try:
            async for delta in engine.generate(prompt, self.params, request_id=rid):
                ids += delta.token_ids
                parts.append(delta.text)
                metrics = delta.metrics or metrics
        except BaseException:
            bm.cancel_pin_on_finish(rid)
            raise
        return self._finish(text, prompt, ids, "".join(parts), metrics, compacted, time.perf_counter() - t0)

    def close(self, from_other_thread: bool = False) -> None:
        """Gives the session's pinned blocks back to the engine (they stay cached until evicted).
        from_other_thread: the engine runs in another thread (AsyncLLM): they go back at its next step."""
        if self.on_async_engine:
            if not self.closed:
                self.llm.unpin(self.id)
            self.closed = True
            return
        bm = self.llm.core.block_manager
        if bm is not None:
            (bm.unpin_later if from_other_thread else bm.unpin)(self.pin)
        self.pin = None
        self.closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- one step, in three parts (step_sessions batches the middle one) -----------------------------

    def _request_id(self) -> str:
        return f"{self.id}/{len(self.records)}"

    def _prepare(self, events, t: float | None = None) -> tuple:
        """(events text, prompt ids, compaction flag) of this interval; validates the events."""
        if self.closed:
            raise RequestError(f"live session {self.id} is closed")
        if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not t >= 0):
            raise RequestError(f"t must be a number of seconds >= 0, got {t!r}")
        t = (len(self.records) + 1) * self.interval_s if t is None else t
        events, items = media_events(events, self.media_processor, self.local_media_root)
        text = render_events(events, t)
        new, placed = self._interval_ids(text, bool(self.records), items)
        compacted = False
        if len(self.ids) + len(new) + self.params.max_tokens > self.max_context:
            self.ids, kept = self._compacted(text, len(new) - len(encode(self.llm.tokenizer,
                                                                         interval_segment(text, True))))
            self.media = []  # a compaction keeps the intervals' text and MEM notes, not their media
            new, placed = self._interval_ids(text, kept > 0, items)
            compacted = True
        media = self.media + placed
        return text, MultimodalPrompt(self.ids + new, media) if media else self.ids + new, compacted

    def _interval_ids(self, text: str, after_decision: bool, items: list) -> tuple[list, list]:
        """An interval's token ids (after the context so far) and its media placed in the whole prompt."""
        return interval_ids(self.llm.tokenizer, self.media_processor, text, after_decision, items, len(self.ids))

    @property
    def media_processor(self):
        """The engine's MediaProcessor (None: a text model)."""
        return self.llm.media_processor

    def _compacted(self, text: str, media_tokens: int = 0) -> tuple:
        """The compacted context (system, MEM notes, the most recent intervals that fit) and how many
        intervals it keeps. media_tokens: what this interval's media add to its text."""
        tok = self.llm.tokenizer
        room = (self.max_context - self.params.max_tokens - len(encode(tok, interval_segment(text, True)))
                - media_tokens)
        if len(self.system_ids) > room:
            raise RequestError(f"live session {self.id}: the system prompt ({len(self.system_ids)} tokens) and this "
                               f"interval do not fit in max_context {self.max_context} with a decision's budget")
        # the newest notes that fit in half of what the system prompt leaves (the oldest go first)
        notes = list(self.notes)
        while notes and len(encode(tok, memory_segment(notes))) > (room - len(self.system_ids)) // 2:
            notes.pop(0)
        self.num_dropped_notes += len(self.notes) - len(notes)
        self.notes = notes
        head = self.system_ids + (encode(tok, memory_segment(notes)) if notes else [])
        kept = []
        for events_text, decision_ids in reversed(self.records[-self.keep_intervals:] if self.keep_intervals else []):
            seg = encode(tok, interval_segment(events_text, after_decision=True)) + decision_ids
            if len(head) + sum(map(len, kept)) + len(seg) > room:
                break
            kept.insert(0, seg)
        if kept:  # the first kept interval follows the head, not a decision
            first_text = self.records[len(self.records) - len(kept)][0]
            kept[0] = encode(tok, interval_segment(first_text, after_decision=False)) + self.records[-len(kept)][1]
        self.num_compactions += 1
        return head + [t for seg in kept for t in seg], len(kept)

    def _finish(self, text: str, prompt: list, token_ids: list, out_text: str, metrics, compacted: bool,
                latency: float) -> Decision:
        """Takes the decision in: its tokens join the context, its MEM note the memory."""
        prompt, media = split_media(prompt)
        ids = list(token_ids)
        completion_tokens = len(ids)
        if not ids or ids[-1] not in self.eos_token_ids:
            ids.append(self.end_id)  # cut by max_tokens (the grammar leaves room, so only without one)
        try:
            d = parse_decision(out_text, self.tasks)
        except DecisionFormatError as e:
            raise RuntimeError(f"live session {self.id}: the decoder wrote {out_text!r}, which the decision "
                               f"grammar should have excluded ({e})") from None
        self.ids = prompt + ids
        self.media = media or []
        self.records.append((text, ids))
        if d.kind == "MEM":
            self.notes.append(d.message)
        m = d.metrics
        m.prompt_tokens = len(prompt)
        m.cached_prompt_tokens = metrics.num_cached_tokens
        m.completion_tokens = completion_tokens
        m.latency_s = latency
        m.decode_flops = metrics.decode_flops
        m.compacted = compacted
        if compacted:
            m.compaction_tokens = len(prompt) - m.cached_prompt_tokens
        self.last_used = time.monotonic()
        return d


def decision_constraint(tasks, max_message_chars: int) -> dict:
    """The SamplingParams fields that hold a decode to the decision grammar."""
    return {"structured": StructuredOutput(regex=decision_regex(tasks, max_message_chars))}


def step_sessions(llm, pairs) -> list:
    """Decides one interval of each (session, events) or (session, events, t) in one batch, alongside
    whatever else the engine runs (other requests' outputs are kept for their own caller, as
    LLM.generate does). Every pair's events are validated before any request is queued."""
    pairs = [tuple(p) + (None,) * (3 - len(p)) for p in pairs]
    sessions = [p[0] for p in pairs]
    if len({id(s) for s in sessions}) != len(sessions):
        raise RequestError("step_sessions: a session appears twice in one batch")
    if any(s.llm is not llm for s in sessions):
        raise RequestError("step_sessions: every session must belong to this engine")
    t0 = time.perf_counter()
    prepared = [s._prepare(events, t) for s, events, t in pairs]
    if llm.core.scheduler is None:
        llm.reserve_kv_cache()
    rids = []
    try:
        for s, (_, prompt, _) in zip(sessions, prepared):
            rid = s._request_id()
            llm.core.block_manager.pin_on_finish(rid, s)
            rids.append(llm.add_request(prompt, s.params, request_id=rid))
        outs = llm.core.run_until_finished(rids)
    except BaseException:
        for s in sessions:
            rid = s._request_id()
            llm.core.block_manager.cancel_pin_on_finish(rid)
            llm.abort(rid)
        raise
    latency = time.perf_counter() - t0
    return [s._finish(text, prompt, outs[rid].outputs[0].token_ids, outs[rid].outputs[0].text, outs[rid].metrics,
                      compacted, latency)
            for s, (text, prompt, compacted), rid in zip(sessions, prepared, rids)]

