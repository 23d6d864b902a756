"""AsyncLLM: the decoder for asyncio services. One background thread owns the LLM and runs its step
loop; every caller, on any event loop, shares it.

    engine = AsyncLLM("path/to/checkpoint", max_num_seqs=64)
    async for delta in engine.generate("Hello", SamplingParams(max_tokens=32)):
        print(delta.text, end="")

Callers never touch the LLM: `add_request` and `abort` are commands the engine thread applies between
steps (so the scheduler has one owner and needs no lock), and each step's outputs go back to the
caller's event loop with `call_soon_threadsafe` right after the step, the first token included. The
forward pass runs off the event loop, so a server stays responsive while the model computes.

Leaving `generate` early — `break`, `aclose()`, or the task being cancelled — aborts the request and
frees its KV blocks at the engine's next turn.
"""
import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import deque
from itertools import count

from engine.llm import LLM, apply_threads
from engine.outputs import RequestOutput
from engine.sampling import SamplingParams
from engine.streaming import OutputDeltas, StreamDelta

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    """The engine ended a request that the caller did not stop: a fault of its own in a step (it alone ends
    with this), or a step that failed as a whole (the requests in flight end with this); the loop goes on
    serving new ones."""


class EngineDeadError(EngineError):
    """The engine loop stopped (shut down, or it crashed); requests in flight and new ones get this."""


class RequestStream:
    """The deltas of one request, as an async iterator on the event loop that added it."""

    def __init__(self, engine: "AsyncLLM", request_id: str, params: SamplingParams, loop):
        self.engine, self.request_id, self.loop = engine, request_id, loop
        self.params = params
        self._queue: asyncio.Queue = asyncio.Queue()
        self._deltas = OutputDeltas(engine.tokenizer, params)
        self._ready: deque[StreamDelta] = deque()
        self._error: BaseException | None = None
        self.finished = False  # the engine sent the last output, or the stream was aborted

    def __aiter__(self):
        return self

    async def __anext__(self) -> StreamDelta:
        while not self._ready:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            if self.finished:
                raise StopAsyncIteration
            self._take([await self._queue.get()])
            self._take_queued()
        return self._ready.popleft()

    def take_ready(self) -> list[StreamDelta]:
        """The deltas that have already arrived, without waiting (a reader that fell behind catches up
        in one go; see streaming.merge_deltas)."""
        self._take_queued()
        ready = list(self._ready)
        self._ready.clear()
        return ready

    def _take_queued(self) -> None:
        items = []
        while not self._queue.empty():
            items.append(self._queue.get_nowait())
        self._take(items)

    def _take(self, items: list) -> None:
        for item in items:
            if isinstance(item, BaseException):
                self.finished, self._error = True, item  # raised once the deltas before it are read
                return
            self._ready.extend(self._deltas.feed(item))
            self.finished |= item.finished

    def _put(self, item: RequestOutput | BaseException) -> None:  # on the loop's thread
        self._queue.put_nowait(item)

    def abort(self) -> None:
        """Stops the request (a no-op once it finished). Safe from any thread."""
        if not self.finished:
            self.finished = True
            self.engine._submit(("abort", self.request_id))

    async def aclose(self) -> None:
        self.abort()


class AsyncLLM:
    def __init__(self, model_path: str | None = None, *, llm: LLM | None = None, dtype=None, device=None,
                 **options):
        if (model_path is None) == (llm is None):
            raise ValueError("AsyncLLM needs a model_path or an llm (one of them)")
        if llm is not None and (options or dtype is not None or device is not None):
            raise ValueError("AsyncLLM(llm=...) takes no engine options: the LLM was configured already")
        self.llm = llm if llm is not None else LLM(model_path, dtype=dtype, device=device, **options)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # the engine thread's
        self._ids = count()
        self._stats = self.llm.stats()
        self._dead: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="livemoe-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_llm(cls, llm: LLM) -> "AsyncLLM":
        return cls(llm=llm)

    @property
    def tokenizer(self):
        return self.llm.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    @property
    def error(self) -> BaseException | None:
        """Why the engine loop stopped (EngineDeadError after shutdown), or None while it runs."""
        return self._dead

    def stats(self) -> dict:
        """LLM.stats() as of the engine's last turn (a snapshot: safe from any thread)."""
        return dict(self._stats)

    # -- the caller's side ------------------------------------------------------------------------

    async def add_request(self, prompt, params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestStream:
        """Queues a request; returns its stream once the engine accepted it (a bad request raises
        RequestError here, before anything is streamed)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead}")
        params = SamplingParams() if params is None else params
        if getattr(params, "structured", None) is not None:  # compiled (and cached) here, off the engine loop
            await asyncio.get_running_loop().run_in_executor(None, self.llm.compile_grammar, params.structured)
        request_id = f"async-{next(self._ids)}" if request_id is None else str(request_id)
        stream = RequestStream(self, request_id, params, asyncio.get_running_loop())
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("add", prompt, params, stream, accepted))
        if not self._thread.is_alive():  # stopped meanwhile: nobody will apply the command
            _settle(accepted, EngineDeadError(f"the engine loop has stopped: {self._dead}"))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            stream.abort()  # queued after the add: applied after it
            raise
        return stream

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None):
        """An async generator of StreamDeltas; leaving it early aborts the request."""
        stream = await self.add_request(prompt, params, request_id)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.abort()

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", str(request_id)))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stops the engine loop; requests in flight end with EngineDeadError."""
        if self._thread.is_alive():
            self._submit(("stop",))
            self._thread.join(timeout)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    def _submit(self, command: tuple) -> None:
        self._commands.put(command)

    # -- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        llm = self.llm
        apply_threads(llm.threads)  # this thread's own OpenMP setting
        try:
            while True:
                if not self._apply_commands(block=not llm.has_unfinished_requests()):
                    break
                if llm.has_unfinished_requests():
                    try:
                        outputs = llm.step()
                    except Exception as e:  # a failed step: end what is in flight, keep serving
                        log.exception("engine step failed; aborting %d request(s)", len(self._streams))
                        self._fail_all(EngineError(f"engine step failed: {e!r}"))
                        outputs = []
                    self._stats = llm.stats()
                    self._deliver(outputs)
                    self._fail_some(llm.take_failed())
        except BaseException as e:  # noqa: BLE001 (the thread must report, whatever it was)
            log.exception("the engine loop died")
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine loop died: {e!r}"))
            self._refuse_queued()
            raise
        self._dead = EngineDeadError("shut down")
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._stats = llm.stats()
        self._refuse_queued()

    def _refuse_queued(self) -> None:
        """Fails the adds that arrived after the loop stopped (their callers are waiting)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _settle(command[-1], EngineDeadError(f"the engine loop has stopped: {self._dead}"))

    def _apply_commands(self, block: bool) -> bool:
        """Applies queued commands (waiting for one when idle); False once told to stop."""
        try:
            command = self._commands.get() if block else self._commands.get_nowait()
        except queue.Empty:
            return True
        while True:
            kind = command[0]
            if kind == "stop":
                return False
            if kind == "add":
                _, prompt, params, stream, accepted = command
                try:
                    self.llm.add_request(prompt, params, stream.request_id)
                except Exception as e:  # RequestError for a bad request: the caller raises it
                    accepted.set_exception(e)
                else:
                    self._streams[stream.request_id] = stream
                    accepted.set_result(None)
            elif kind == "abort":
                if self._streams.pop(command[1], None) is not None:
                    self.llm.abort(command[1])
            else:
                raise AssertionError(f"unknown engine command {kind!r}")
            self._stats = self.llm.stats()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        by_loop: dict = {}
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if out.finished:
                del self._streams[out.request_id]
            by_loop.setdefault(stream.loop, []).append((stream, out))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_put_all, items)
            except RuntimeError:  # the caller's loop is closed: nobody will read these
                for stream, out in items:
                    if not out.finished:
                        self._streams.pop(stream.request_id, None)
                        self.llm.abort(stream.request_id)

    def _fail_some(self, failed: dict[str, str]) -> None:
        """Ends the streams of requests the engine failed alone (after their earlier outputs)."""
        for rid, why in failed.items():
            stream = self._streams.pop(rid, None)
            if stream is not None:
                try:
                    stream.loop.call_soon_threadsafe(stream._put, EngineError(f"request {rid} failed: {why}"))
                except RuntimeError:
                    pass

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for rid, stream in streams.items():
            self.llm.abort(rid)
            try:
                stream.loop.call_soon_threadsafe(stream._put, error)
            except RuntimeError:
                pass


def _settle(future: concurrent.futures.Future, error: BaseException) -> None:
    try:
        future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass  # the engine settled it first


def _put_all(items) -> None:
    for stream, out in items:
        stream._put(out)
