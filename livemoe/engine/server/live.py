"""HTTP endpoints of live sessions (livemoe.engine.live), on the server's AsyncLLM:

    POST   /v1/live/sessions             {"system", "interval_s"?, "max_message_chars"?, "max_context"?,
                                          "keep_intervals"?, "temperature"?, "seed"?}  -> {"id", "object"}
    POST   /v1/live/sessions/{id}/step   {"events": [{"type", "user", "text"}, ...] | "text", "t"?}
                                          -> {"kind", "recipient", "task", "message", "metrics"}
    DELETE /v1/live/sessions/{id}        -> {"id", "deleted": true}

An unknown id is a 404; bad events or fields a 400 naming them; a `max_context` too small for one step a 400
at create; more than `--max-live-sessions` open a 429. Events are tokenized off the event loop (a text longer
than the context can hold is refused from its length first), so a large step does not stall other requests.
Sessions work on either engine core (livemoe.engine.live.session: the core keeps their blocks pinned). One step
of a session runs at a time (a second one waits for the first). Sessions idle for longer than `idle_timeout_s`
are closed at the next call to any of these endpoints, and their pinned KV blocks go back to the engine at its
next step.
/metrics gains livemoe_live_sessions (open), livemoe_live_decisions{kind} and the decision latency.
"""
import asyncio
import dataclasses
import time
from typing import Any

from fastapi import APIRouter, HTTPException
from prometheus_client import Counter, Gauge, Histogram
from pydantic import BaseModel, ConfigDict, Field

from livemoe.engine.live import KINDS, LiveSession
from livemoe.engine.live.decision import MAX_MESSAGE_CHARS

IDLE_TIMEOUT_S = 600.0
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SessionRequest(_Body):
    system: str = Field(min_length=1)
    interval_s: float = Field(default=10.0, gt=0)
    max_message_chars: int = Field(default=MAX_MESSAGE_CHARS, ge=1, le=4096)
    max_context: int | None = Field(default=None, ge=1)
    keep_intervals: int = Field(default=4, ge=0)
    temperature: float = Field(default=0.0, ge=0, le=2)
    seed: int | None = Field(default=None, ge=0, lt=2**63)


class StepRequest(_Body):
    events: list[dict[str, Any]] | str
    t: float | None = Field(default=None, ge=0)


class _Open:
    __slots__ = ("session", "lock")

    def __init__(self, session: LiveSession):
        self.session, self.lock = session, asyncio.Lock()


def live_router(server, idle_timeout_s: float | None = None) -> APIRouter:
    """The endpoints over `server.engine` (an AsyncLLM), metrics in `server.metrics.registry`;
    idle_timeout_s defaults to IDLE_TIMEOUT_S (read when the app is built)."""
    idle_timeout_s = IDLE_TIMEOUT_S if idle_timeout_s is None else idle_timeout_s
    router = APIRouter(prefix="/v1/live/sessions")
    engine = server.engine
    open_sessions: dict[str, _Open] = {}
    creating: set = set()  # creates under way (counted against the cap)
    registry = server.metrics.registry
    gauge = Gauge("livemoe_live_sessions", "Live sessions open", registry=registry)
    decisions = Counter("livemoe_live_decisions", "Live-session decisions by kind", ["kind"], registry=registry)
    for kind in KINDS:
        decisions.labels(kind)
    latency = Histogram("livemoe_live_decision_latency_seconds", "Events in to decision out",
                        buckets=LATENCY_BUCKETS, registry=registry)

    def close(entry: _Open) -> None:
        entry.session.close(from_other_thread=True)
        open_sessions.pop(entry.session.id, None)
        gauge.set(len(open_sessions))

    def expire() -> None:
        now = time.monotonic()
        for entry in list(open_sessions.values()):
            if not entry.lock.locked() and now - entry.session.last_used > idle_timeout_s:
                close(entry)

    def find(session_id: str) -> _Open:
        entry = open_sessions.get(session_id)
        if entry is None:
            raise HTTPException(404, f"no live session {session_id!r} (never opened, deleted, or expired after "
                                     f"{idle_timeout_s:g} s idle)")
        return entry

    def check_text_fits(events) -> None:
        """A text that cannot fit the context is refused from its length, before seconds of tokenizing."""
        if isinstance(events, str):
            server.check_text_fits(len(events))
        else:
            server.check_text_fits(sum(len(v) for e in events if isinstance(e, dict) for k, v in e.items()
                                       if k in ("user", "text") and isinstance(v, str)))  # not media data

    @router.post("")
    async def create(body: SessionRequest):
        expire()
        limit = server.config.max_live_sessions
        if len(open_sessions) + len(creating) >= limit:
            raise HTTPException(429, f"{len(open_sessions)} live sessions are open, this server's limit "
                                     f"(--max-live-sessions {limit}); delete one (DELETE /v1/live/sessions/ID) or "
                                     f"wait for idle ones to expire ({idle_timeout_s:g} s)")
        server.check_text_fits(len(body.system))
        token = object()
        creating.add(token)
        try:  # the system prompt is tokenized off the event loop
            session = await asyncio.to_thread(lambda: LiveSession(
                engine, body.system, interval_s=body.interval_s, max_message_chars=body.max_message_chars,
                max_context=body.max_context, keep_intervals=body.keep_intervals, temperature=body.temperature,
                seed=body.seed, local_media_root=server.config.allowed_local_media_path))
        finally:
            creating.discard(token)
        open_sessions[session.id] = _Open(session)
        gauge.set(len(open_sessions))
        return {"id": session.id, "object": "live.session"}

    @router.post("/{session_id}/step")
    async def step(session_id: str, body: StepRequest):
        expire()
        entry = find(session_id)
        async with entry.lock:
            if entry.session.closed:
                raise HTTPException(404, f"live session {session_id!r} was closed")
            check_text_fits(body.events)
            d = await entry.session.astep(engine, body.events, body.t)
        decisions.labels(d.kind).inc()
        latency.observe(d.metrics.latency_s)
        return {**d.to_json(), "metrics": dataclasses.asdict(d.metrics)}

    @router.delete("/{session_id}")
    async def delete(session_id: str):
        expire()
        entry = find(session_id)
        async with entry.lock:
            close(entry)
        return {"id": session_id, "deleted": True}

    return router

