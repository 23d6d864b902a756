"""AsyncLLM: the decoder for asyncio services, a thin API over an engine-core client (livemoe/engine/core/):

    engine = AsyncLLM("path/to/checkpoint", max_num_seqs=64)
    async for delta in engine.generate("Hello", SamplingParams(max_tokens=32)):
        print(delta.text, end="")

engine_core="thread" (the default) runs the engine in a background thread of this process (InprocClient), whose
module a trainer can share (AsyncLLM.from_llm); engine_core="process" runs it in engine-core processes
(MPClient: ZeroMQ and msgpack, as vLLM v1), `data_parallel_size` of them, one per device in `devices`
(CUDA_VISIBLE_DEVICES values): this process then only tokenizes, detokenizes and streams, and a busy event loop
(an HTTP server) no longer shares an interpreter lock with the forward passes. The API is the same, less `.llm`.

Requests are tokenized here and validated by the core (a bad one raises RequestError from add_request, before
anything is streamed). Leaving `generate` early (`break`, `aclose()`, or the task being cancelled) aborts the
request and frees its KV blocks at the engine's next turn. A request the engine ends alone ends with EngineError;
a core that dies ends its requests with EngineDeadError.

Weights and memory, on every replica (rollout servers for RL): `update_weights`, `update_weights_from_disk`,
`init_weights_update_group` + `update_weights_from_distributed` (engine-core processes), `sleep` and `wake_up`
(awaitables; see LLM.update_weights for `in_flight`).
"""
import asyncio
import concurrent.futures
import logging
from collections import deque
from itertools import count

from livemoe.engine.core.client import EngineCoreClient
from livemoe.engine.core.inproc import InprocClient
from livemoe.engine.core.mp_client import MPClient
from livemoe.engine.decoder.config import EngineConfig
from livemoe.engine.decoder.engine_core import IN_FLIGHT_MODES
from livemoe.engine.decoder.input_processor import tokenize_prompt
from livemoe.engine.errors import GrammarCompileTimeout, RequestError
from livemoe.engine.llm import LLM
from livemoe.engine.model.config import load_config
from livemoe.engine.model.loader import load_tokenizer
from livemoe.engine.multimodal.processor import MediaProcessor
from livemoe.engine.multimodal.media import split_media
from livemoe.engine.outputs import RequestOutput
from livemoe.engine.sampling.params import SamplingParams
from livemoe.engine.text.streaming import OutputDeltas, StreamDelta

log = logging.getLogger(__name__)


class RequestStream:
    """The deltas of one request, as an async iterator on the event loop that added it."""

    def __init__(self, client, tokenizer, request_id: str, params: SamplingParams, loop):
        self.client, self.request_id, self.loop = client, request_id, loop
        self.params = params
        self._queue: asyncio.Queue = asyncio.Queue()
        self._deltas = OutputDeltas(tokenizer, params)
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
            self.client.abort(self.request_id)

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
        self._ids = count()
        self._media: tuple = (None, None)  # (OmniConfig, EngineConfig) of an engine in other processes
        self._media_processor: MediaProcessor | None = None
        # compiles with a time budget wait here (a compile past it runs on: its thread stays taken until it ends)
        self._compile_pool = concurrent.futures.ThreadPoolExecutor(8, thread_name_prefix="livemoe-grammar")
        self._slow_compiles: set[str] = set()  # specs whose compile ran past a budget and has not ended yet
        self.client: EngineCoreClient
        if engine_core == "thread":
            if data_parallel_size != 1 or devices is not None or on_core_death is not None:
                raise ValueError("data_parallel_size, devices and on_core_death need engine_core='process'")
            owns = llm is None
            self.client = InprocClient(LLM(model_path, dtype=dtype, device=device, **options) if owns else llm, owns)
            self.tensor_parallel_size = self.client.llm.config.tensor_parallel_size
            return
        if llm is not None:
            raise ValueError("engine_core='process' loads the checkpoint in its own process; it cannot take "
                             "an llm (use engine_core='thread' to share a module)")
        config = EngineConfig.from_options(**options)  # bad options fail here, before any process starts
        self.tensor_parallel_size = config.tensor_parallel_size  # of each replica
        if devices is not None and len(devices) != data_parallel_size:
            raise ValueError(f"devices: {len(devices)} given for data_parallel_size {data_parallel_size}")
        self.client = MPClient(model_path, dict(options, dtype=dtype, device=device), load_tokenizer(model_path),
                               data_parallel_size, devices, on_core_death, logging.getLogger().level)
        self._media = (load_config(model_path).omni, config)  # media are processed here, encoded in the cores

    @property
    def media_processor(self) -> MediaProcessor | None:
        """Turns media into what the model's encoders take, in this process (None: a text model)."""
        if self.client.llm is not None:
            return self.client.llm.media_processor
        omni, config = self._media
        if omni is None:
            return None
        if self._media_processor is None:
            self._media_processor = MediaProcessor(omni, config)
        return self._media_processor

    @classmethod
    def from_llm(cls, llm: LLM) -> "AsyncLLM":
        return cls(llm=llm)

    @property
    def llm(self) -> LLM | None:
        """The engine's LLM when it runs in this process (engine_core="thread"), else None."""
        return self.client.llm

    @property
    def tokenizer(self):
        return self.client.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.client.max_model_len

    @property
    def block_size(self) -> int:
        return self.client.block_size

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self.client.eos_token_ids

    @property
    def data_parallel_size(self) -> int:
        return self.client.num_replicas

    @property
    def error(self) -> BaseException | None:
        """Why the engine stopped (EngineDeadError after shutdown), or None while it runs. With several engine
        cores: the first dead replica's error (the others may serve on: replica_errors())."""
        return next((e for e in self.replica_errors() if e is not None), None)

    def replica_errors(self) -> list[BaseException | None]:
        return self.client.errors()

    def stats(self) -> dict:
        """LLM.stats() as of the engine's last turn (a snapshot: safe from any thread); with several
        replicas, their sum (rates averaged, last_logits_finite only if on every one)."""
        stats = self.client.stats()
        return merge_stats([s for s in stats if s] or stats)  # (a replica restarting has no stats yet)

    def replica_stats(self) -> list[dict]:
        return self.client.stats()

    def core_pids(self) -> list[int]:
        """The engine-core processes' ids (none with engine_core='thread')."""
        return self.client.core_pids()

    def restart_replica(self, index: int) -> None:
        """Starts a fresh engine core for a dead replica (it serves again once loaded)."""
        self.client.restart(index)

    def served_per_replica(self) -> list[int]:
        """Requests routed to each replica so far."""
        return self.client.served_per_replica()

    def max_sequence_tokens(self) -> int:
        """Tokens one sequence may hold: the context, or the smallest replica's whole KV cache if less."""
        blocks = min(self._serving_stats("kv_blocks_total"), default=0) or self.max_model_len // self.block_size
        return min(self.max_model_len, blocks * self.block_size)

    def compile_grammar(self, spec, field: str = "structured", timeout_s: float | None = None):
        """Compiles (and caches) an output constraint where the engine runs; a bad spec raises RequestError.
        Blocking: call it off the event loop. timeout_s: a budget; past it GrammarCompileTimeout (a RequestError).
        A compile cannot be stopped: it runs on where the engine is (xgrammar releases the interpreter lock, so
        the steps go on) and is cached when done; until then the same spec is refused at once."""
        if timeout_s is None:
            self.client.compile_grammar(spec, field)
            return
        key = spec.key
        if key in self._slow_compiles:
            raise GrammarCompileTimeout(f"{field}: compiling this constraint takes over {timeout_s:g} s (a compile of "
                                        "it is still running); simplify it")
        done = self._compile_pool.submit(self.client.compile_grammar, spec, field)
        try:
            done.result(timeout_s)
        except concurrent.futures.TimeoutError:
            self._slow_compiles.add(key)
            done.add_done_callback(lambda _: self._slow_compiles.discard(key))
            raise GrammarCompileTimeout(f"{field}: compiling this constraint took over {timeout_s:g} s; simplify it "
                                        "(long repetition counts such as {1,5000} and huge enums cost the most)"
                                        ) from None

    # -- requests -----------------------------------------------------------------------------------

    async def add_request(self, prompt, params: SamplingParams | None = None,
                          request_id: str | None = None, pin_key: str | None = None) -> RequestStream:
        """Queues a request; returns its stream once the engine accepted it (a bad request raises
        RequestError here, before anything is streamed). pin_key: a live session's (livemoe.engine.live): its
        requests go to one engine core, which keeps their KV blocks pinned between them until unpin(pin_key)."""
        self.client.check_alive()
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise RequestError(f"params must be SamplingParams, got {type(params).__name__}")
        loop = asyncio.get_running_loop()
        if params.structured is not None:  # compiled (and cached) here, off the engine loop
            await loop.run_in_executor(None, self.compile_grammar, params.structured)
        request_id = f"async-{next(self._ids)}" if request_id is None else str(request_id)
        prompt, media = split_media(prompt)
        text, prompt_ids = tokenize_prompt(self.tokenizer, prompt)  # only ids (and media) go to the core
        stream = RequestStream(self.client, self.tokenizer, request_id, params, loop)
        accepted = self.client.add(request_id, text, prompt_ids, params, stream, pin_key, media)
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            stream.abort()  # queued after the add: applied after it
            raise
        except BaseException:
            self.client.abort(request_id)
            raise
        return stream

    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       pin_key: str | None = None):
        """An async generator of StreamDeltas; leaving it early aborts the request."""
        stream = await self.add_request(prompt, params, request_id, pin_key)
        try:
            async for delta in stream:
                yield delta
        finally:
            stream.abort()

    async def abort(self, request_id: str) -> None:
        self.client.abort(str(request_id))

    def unpin(self, pin_key: str) -> None:
        """Gives back the KV blocks kept for pin_key (add_request) at the engine's next turn; safe from any thread."""
        self.client.unpin(pin_key)

    # -- weights and memory -------------------------------------------------------------------------

    async def update_weights(self, named_tensors, in_flight: str = "finish", weight_version: int | None = None) -> int:
        """LLM.update_weights on every replica (the tensors are sent to each core); the number copied."""
        named = list(named_tensors.items() if isinstance(named_tensors, dict) else named_tensors)
        return (await self._call_all("update_weights", named, in_flight=in_flight, weight_version=weight_version))[0]

    async def update_weights_from_disk(self, model_path: str, in_flight: str = "finish",
                                       weight_version: int | None = None) -> int:
        return (await self._call_all("update_weights_from_disk", str(model_path), in_flight=in_flight,
                                     weight_version=weight_version))[0]

    @property
    def weight_update_ranks(self) -> int:
        """The ranks this engine takes in a trainer's weight-update group: one per process that holds weights
        (data_parallel_size replicas of tensor_parallel_size ranks each)."""
        return self.data_parallel_size * self.tensor_parallel_size


    async def init_weights_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, backend: str = "gloo", timeout_s: float = 300.0) -> None:
        """Every process holding weights joins the trainer's weight-update group (the trainer is rank 0): replica
        i's tensor-parallel rank r as rank_offset + i * tensor_parallel_size + r, so each receives the broadcast
        and keeps its own slices. Answers once every replica has joined (the trainer joins meanwhile)."""
        tp = self.tensor_parallel_size
        futures = [self.client.call("init_weights_update_group", replicas=[i], master_address=master_address,
                                    master_port=master_port, rank=rank_offset + i * tp, world_size=world_size,
                                    backend=backend, timeout_s=timeout_s)[0] for i in range(self.data_parallel_size)]
        await asyncio.gather(*map(asyncio.wrap_future, futures))

    async def update_weights_from_distributed(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                                              in_flight: str = "finish", weight_version: int | None = None) -> int:
        """Receives the tensors the trainer broadcasts (in this order) and copies them in, on every replica."""
        return (await self._call_all("update_weights_from_distributed", list(names), list(dtypes),
                                     [list(s) for s in shapes], in_flight=in_flight,
                                     weight_version=weight_version))[0]

    async def sleep(self, level: int = 1) -> None:
        """Frees the KV cache (level 2: and moves the weights to the host) on every replica; requests in
        flight are aborted and new ones refused until wake_up()."""
        await self._call_all("sleep", level)

    async def wake_up(self) -> None:
        await self._call_all("wake_up")

    @property
    def sleep_level(self) -> int:
        return max(self._serving_stats("sleep_level"), default=0)

    def _serving_stats(self, key: str) -> list:
        """key's value on each replica that serves (a dead or restarting one is skipped: its stats are stale or
        missing), or on every replica that has it when none serves."""
        stats, errors = self.replica_stats(), self.replica_errors()
        serving = [s[key] for s, e in zip(stats, errors) if e is None and key in s]
        return serving or [s[key] for s in stats if key in s]

    async def _call_all(self, method: str, *args, **kwargs) -> list:
        in_flight = kwargs.get("in_flight")
        if in_flight is not None and in_flight not in IN_FLIGHT_MODES:
            raise ValueError(f"in_flight must be one of {IN_FLIGHT_MODES}, got {in_flight!r}")
        return list(await asyncio.gather(*map(asyncio.wrap_future, self.client.call(method, *args, **kwargs))))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        """Stops the engine; requests in flight end with EngineDeadError."""
        self.client.shutdown(10.0 if timeout is None else timeout)
        self._compile_pool.shutdown(wait=False, cancel_futures=True)

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc):
        await asyncio.get_running_loop().run_in_executor(None, self.shutdown)


LAYOUT_KEYS = ("tensor_parallel_size", "expert_parallel")


def merge_stats(stats: list[dict]) -> dict:
    """Replicas' LLM.stats() as one: counts summed, rates averaged, flags true only if true on all."""
    if len(stats) == 1:
        return dict(stats[0])
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
