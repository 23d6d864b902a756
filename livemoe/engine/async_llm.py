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

engine_core="process" runs the engine (scheduler, runner, model) in engine-core processes instead
(livemoe/engine/core/: ZeroMQ and msgpack, as vLLM v1), `data_parallel_size` of them, one per device in `devices`
(CUDA_VISIBLE_DEVICES values); this process then only tokenizes, detokenizes and streams, and a busy
event loop (an HTTP server) no longer shares an interpreter lock with the forward passes. The API is
the same, less `.llm`; a core that dies ends its requests with EngineDeadError. engine_core="thread"
(the default) keeps the engine in this process: a trainer's module is shared (AsyncLLM.from_llm).

Weights and memory, in both modes (rollout servers for RL): `update_weights`, `update_weights_from_disk`,
`init_weights_update_group` + `update_weights_from_distributed`, `sleep` and `wake_up` (awaitables; on
every replica; see LLM.update_weights for `in_flight`).
"""
import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections import deque
from itertools import count

from livemoe.engine.core.delivery import deliver, settle
from livemoe.engine.errors import EngineDeadError, EngineError, EngineSleepingError, WorkerError
from livemoe.engine.decoder.config import apply_threads
from livemoe.engine.decoder.engine_core import IN_FLIGHT_MODES
from livemoe.engine.decoder.input_processor import tokenize_prompt
from livemoe.engine.llm import LLM
from livemoe.engine.outputs import RequestOutput
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.errors import RequestError
from livemoe.engine.text.streaming import OutputDeltas, StreamDelta

log = logging.getLogger(__name__)


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

    def push(self, item: RequestOutput | BaseException) -> None:  # on the loop's thread
        self._queue.put_nowait(item)

    def abort(self) -> None:
        """Stops the request (a no-op once it finished). Safe from any thread."""
        if not self.finished:
            self.finished = True
            self.engine._submit(("abort", self.request_id))

    async def aclose(self) -> None:
        self.abort()


ENGINE_CORES = ("thread", "process")


class AsyncLLM:
    def __init__(self, model_path: str | None = None, *, llm: LLM | None = None, dtype=None, device=None,
                 engine_core: str = "thread", data_parallel_size: int = 1, devices: list[str] | None = None,
                 on_core_death=None, **options):
        if (model_path is None) == (llm is None):
            raise ValueError("AsyncLLM needs a model_path or an llm (one of them)")
        if llm is not None and (options or dtype is not None or device is not None):
            raise ValueError("AsyncLLM(llm=...) takes no engine options: the LLM was configured already")
        if engine_core not in ENGINE_CORES:
            raise ValueError(f"engine_core must be one of {ENGINE_CORES}, got {engine_core!r}")
        if engine_core == "thread" and (data_parallel_size != 1 or devices is not None or on_core_death is not None):
            raise ValueError("data_parallel_size, devices and on_core_death need engine_core='process'")
        self._core = None
        self._dead: BaseException | None = None
        self._ids = count()
        if engine_core == "process":
            if llm is not None:
                raise ValueError("engine_core='process' loads the checkpoint in its own process; it cannot take "
                                 "an llm (use engine_core='thread' to share a module)")
            self.llm = None  # it lives in the core process(es)
            self._start_cores(model_path, dtype, device, data_parallel_size, devices, on_core_death, options)
            return
        self._owns_llm = llm is None
        self.llm = llm if llm is not None else LLM(model_path, dtype=dtype, device=device, **options)
        self._tokenizer = self.llm.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, RequestStream] = {}  # the engine thread's
        self._stats = self._llm_stats()
        self._thread = threading.Thread(target=self._run, name="livemoe-engine", daemon=True)
        self._thread.start()

    def _start_cores(self, model_path, dtype, device, data_parallel_size, devices, on_core_death, options) -> None:
        from livemoe.engine.core.client import CoreClient
        from livemoe.engine.decoder.config import EngineConfig
        from livemoe.engine.model.loader import load_tokenizer

        config = EngineConfig.from_options(**options)  # bad options fail here, before any process starts
        if data_parallel_size > 1 and config.tensor_parallel_size > 1:
            raise ValueError(f"data_parallel_size={data_parallel_size} with tensor_parallel_size="
                             f"{config.tensor_parallel_size} is not supported: run one engine per group of GPUs")
        if devices is not None and len(devices) != data_parallel_size:
            raise ValueError(f"devices: {len(devices)} given for data_parallel_size {data_parallel_size}")
        self._tokenizer = load_tokenizer(model_path)
        self._core = CoreClient(model_path, dict(options, dtype=dtype, device=device), self._tokenizer,
                                data_parallel_size, devices, on_core_death, logging.getLogger().level)

    @classmethod
    def from_llm(cls, llm: LLM) -> "AsyncLLM":
        return cls(llm=llm)

    @property
    def tokenizer(self):
        return self._tokenizer

    @property
    def max_model_len(self) -> int:
        return self._core.max_model_len if self._core is not None else self.llm.max_model_len

    @property
    def block_size(self) -> int:
        return self._core.block_size if self._core is not None else self.llm.config.block_size

    @property
    def data_parallel_size(self) -> int:
        return len(self._core.replicas) if self._core is not None else 1

    @property
    def error(self) -> BaseException | None:
        """Why the engine loop stopped (EngineDeadError after shutdown), or None while it runs. With engine
        cores: the first dead replica's error (the others may serve on: replica_errors())."""
        if self._core is not None:
            return next((e for e in self.replica_errors() if e is not None), None)
        return self._dead

    def replica_errors(self) -> list[BaseException | None]:
        if self._core is None:
            return [self._dead]
        return [r.error for r in self._core.replicas]

    def stats(self) -> dict:
        """LLM.stats() as of the engine's last turn (a snapshot: safe from any thread); with several
        replicas, their sum (rates averaged, last_logits_finite only if on every one)."""
        if self._core is None:
            return dict(self._stats)
        return merge_stats(self._core.stats())

    def replica_stats(self) -> list[dict]:
        return self._core.stats() if self._core is not None else [self.stats()]

    def core_pids(self) -> list[int]:
        """The engine-core processes' ids (none with engine_core='thread')."""
        return [r.process.pid for r in self._core.replicas] if self._core is not None else []

    def restart_replica(self, index: int) -> None:
        """Starts a fresh engine core for a dead replica (it serves again once loaded)."""
        self._core.restart(index)

    def served_per_replica(self) -> list[int]:
        """Requests routed to each replica so far."""
        return list(self._core.router.served) if self._core is not None else [0]

    def max_sequence_tokens(self) -> int:
        """Tokens one sequence may hold: the context, or the smallest replica's whole KV cache if less."""
        blocks = min(s["kv_blocks_total"] for s in self.replica_stats())
        return min(self.max_model_len, blocks * self.block_size)

    def compile_grammar(self, spec, field: str = "structured"):
        """Compiles (and caches) an output constraint where the engine runs; a bad spec raises RequestError.
        Blocking: call it off the event loop."""
        if self._core is None:
            return self.llm.compile_grammar(spec, field)
        for f in self._core.call("compile_grammar", spec, field):
            f.result()

    # -- the caller's side ------------------------------------------------------------------------

    async def add_request(self, prompt, params: SamplingParams | None = None,
                          request_id: str | None = None) -> RequestStream:
        """Queues a request; returns its stream once the engine accepted it (a bad request raises
        RequestError here, before anything is streamed)."""
        if self._dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self._dead}")
        params = SamplingParams() if params is None else params
        if getattr(params, "structured", None) is not None:  # compiled (and cached) here, off the engine loop
            await asyncio.get_running_loop().run_in_executor(None, self.compile_grammar, params.structured)
        request_id = f"async-{next(self._ids)}" if request_id is None else str(request_id)
        stream = RequestStream(self, request_id, params, asyncio.get_running_loop())
        if self._core is not None:
            return await self._add_to_core(prompt, params, stream)
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("add", prompt, params, stream, accepted))
        if not self._thread.is_alive():  # stopped meanwhile: nobody will apply the command
            settle(accepted, EngineDeadError(f"the engine loop has stopped: {self._dead}"))
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

    async def _add_to_core(self, prompt, params: SamplingParams, stream: RequestStream) -> RequestStream:
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        text, prompt_ids = tokenize_prompt(self._tokenizer, prompt)  # tokenized here: only ids go to the core
        accepted = self._core.add(stream.request_id, text, prompt_ids, params, stream)
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            stream.abort()
            raise
        except BaseException:
            self._core.abort(stream.request_id)
            raise
        return stream

    async def abort(self, request_id: str) -> None:
        self._submit(("abort", str(request_id)))

    # -- weights and memory -------------------------------------------------------------------------

    async def update_weights(self, named_tensors, in_flight: str = "finish") -> int:
        """LLM.update_weights on every replica (the tensors are sent to each core); the number copied."""
        named = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        return (await self._call_all("update_weights", named, in_flight=in_flight))[0]

    async def update_weights_from_disk(self, model_path: str, in_flight: str = "finish") -> int:
        return (await self._call_all("update_weights_from_disk", str(model_path), in_flight=in_flight))[0]

    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, backend: str = "gloo", timeout_s: float = 300.0) -> None:
        """Each replica joins the trainer's weight-update group as rank rank_offset + its index (the
        trainer is rank 0). Answers once every replica has joined (the trainer joins meanwhile)."""
        if self._core is None:
            raise RuntimeError("init_weights_update_group needs engine_core='process' (in a thread, share the "
                               "trainer's module instead)")
        futures = [self._core.call("init_weights_update_group", replicas=[i], master_address=master_address,
                                   master_port=master_port, rank=rank_offset + i, world_size=world_size,
                                   backend=backend, timeout_s=timeout_s)[0] for i in range(self.data_parallel_size)]
        await asyncio.gather(*map(asyncio.wrap_future, futures))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              in_flight: str = "finish") -> int:
        """Receives the tensors the trainer broadcasts (in this order) and copies them in, on every replica."""
        if self._core is None:
            raise RuntimeError("update_weights_from_distributed needs engine_core='process'")
        return (await self._call_all("update_weights_from_distributed", list(names), list(dtypes),
                                     [list(s) for s in shapes], in_flight=in_flight))[0]

    async def sleep(self, level: int = 1) -> None:
        """Frees the KV cache (level 2: and moves the weights to the host) on every replica; requests in
        flight are aborted and new ones refused until wake_up()."""
        await self._call_all("sleep", level)

    async def wake_up(self) -> None:
        await self._call_all("wake_up")

    @property
    def sleep_level(self) -> int:
        return max(s.get("sleep_level", 0) for s in self.replica_stats())

    async def _call_all(self, method: str, *args, **kwargs) -> list:
        in_flight = kwargs.get("in_flight")
        if in_flight is not None and in_flight not in IN_FLIGHT_MODES:
            raise ValueError(f"in_flight must be one of {IN_FLIGHT_MODES}, got {in_flight!r}")
        if self._core is not None:
            return list(await asyncio.gather(*map(asyncio.wrap_future, self._core.call(method, *args, **kwargs))))
        done: concurrent.futures.Future = concurrent.futures.Future()
        self._submit(("call", method, args, kwargs, done))
        return [await asyncio.wrap_future(done)]

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stops the engine loop; requests in flight end with EngineDeadError."""
        if self._core is not None:
            self._core.shutdown(10.0 if timeout is None else timeout)
            return
        if self._thread.is_alive():
            self._submit(("stop",))
            self._thread.join(timeout)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)

    def _submit(self, command: tuple) -> None:
        if self._core is not None:
            assert command[0] == "abort", command
            self._core.abort(command[1])
            return
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
                    except WorkerError:  # a tensor-parallel worker is gone: no step can run any more
                        raise
                    except Exception as e:  # a failed step: end what is in flight, keep serving
                        log.exception("engine step failed; aborting %d request(s)", len(self._streams))
                        self._fail_all(EngineError(f"engine step failed: {e!r}"))
                        outputs = []
                    self._stats = self._llm_stats()
                    self._deliver(outputs)
                    self._fail_some(llm.take_failed())
        except BaseException as e:  # noqa: BLE001 (the thread must report, whatever it was)
            log.exception("the engine loop died")
            self._dead = e
            self._fail_all(EngineDeadError(f"the engine loop died: {e!r}"))
            self._refuse_queued()
            raise
        finally:
            if self._owns_llm:
                llm.close()  # its tensor-parallel workers stop with the loop
        self._dead = EngineDeadError("shut down")
        self._fail_all(EngineDeadError("the engine was shut down"))
        self._stats = self._llm_stats()
        self._refuse_queued()

    def _llm_stats(self) -> dict:
        return dict(self.llm.stats(), sleep_level=self.llm.sleep_level)

    def _refuse_queued(self) -> None:
        """Fails the adds that arrived after the loop stopped (their callers are waiting)."""
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                settle(command[-1], EngineDeadError(f"the engine loop has stopped: {self._dead}"))

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
                    if self.llm.sleep_level:
                        raise EngineSleepingError("the engine is asleep (wake_up() first)")
                    self.llm.add_request(prompt, params, stream.request_id)
                except Exception as e:  # RequestError for a bad request: the caller raises it
                    accepted.set_exception(e)
                else:
                    self._streams[stream.request_id] = stream
                    accepted.set_result(None)
            elif kind == "abort":
                if self._streams.pop(command[1], None) is not None:
                    self.llm.abort(command[1])
            elif kind == "call":  # a weight update or sleep: requests it ends get their error, then outputs
                _, method, args, kwargs, done = command
                try:
                    if method == "sleep":
                        kwargs = dict(kwargs, in_flight="abort")
                    result = getattr(self.llm, method)(*args, **kwargs)
                except Exception as e:  # noqa: BLE001 (the caller raises it)
                    done.set_exception(e)
                else:
                    done.set_result(result)
                self._fail_some(self.llm.take_failed())
                self._deliver(self.llm.step() if not self.llm.has_unfinished_requests() else [])
            else:
                raise AssertionError(f"unknown engine command {kind!r}")
            self._stats = self._llm_stats()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return True

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        items = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if out.finished:
                del self._streams[out.request_id]
            items.append((stream, out))
        deliver(items, self._unread)

    def _unread(self, stream: RequestStream, out) -> None:
        if not out.finished:  # nobody will read it: stop computing it
            self._streams.pop(stream.request_id, None)
            self.llm.abort(stream.request_id)

    def _fail_some(self, failed: dict[str, str]) -> None:
        """Ends the streams of requests the engine failed alone (after their earlier outputs)."""
        deliver([(stream, EngineError(f"request {rid} failed: {why}")) for rid, why in failed.items()
                 if (stream := self._streams.pop(rid, None)) is not None])

    def _fail_all(self, error: BaseException) -> None:
        streams, self._streams = self._streams, {}
        for rid in streams:
            self.llm.abort(rid)
        deliver([(stream, error) for stream in streams.values()])


LAYOUT_KEYS = ("tensor_parallel_size", "expert_parallel")


def merge_stats(stats: list[dict]) -> dict:
    """Replicas' LLM.stats() as one: counts summed, rates averaged, flags true only if true on all."""
    merged = {}
    for key, value in stats[0].items():
        values = [s.get(key, value) for s in stats]
        if key in LAYOUT_KEYS:  # the same on every replica
            merged[key] = value
        elif isinstance(value, bool):
            merged[key] = all(values)
        elif isinstance(value, float):
            merged[key] = sum(values) / len(values)
        else:
            merged[key] = sum(values)
    queries = merged.get("prefix_cache_queries", 0)
    if "prefix_cache_hit_rate" in merged and queries:
        merged["prefix_cache_hit_rate"] = merged["prefix_cache_hits"] / queries
    return merged
