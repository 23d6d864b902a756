"""EngineCoreClient: what AsyncLLM asks of the engine, whichever core runs it (vLLM v1's EngineCoreClient):

- InprocClient (inproc.py): one engine thread in this process over an LLM; a trainer's module can be shared;
- MPClient (mp_client.py): N engine-core processes (data-parallel replicas), ZeroMQ and msgpack, a router.

Both speak the one command protocol (service.py): requests are tokenized by the caller and validated by the core;
each step's outputs go to the callers' event loops as they are made; a request the engine ends on its own ends
its stream with EngineError, and a core that stops ends its requests with EngineDeadError.
"""
import concurrent.futures
from abc import ABC, abstractmethod
from typing import Any

from livemoe.engine.llm import LLM
from livemoe.engine.sampling.params import SamplingParams


class EngineCoreClient(ABC):
    tokenizer: Any = None  # the checkpoint's tokenizer (None: it has none)
    max_model_len: int
    block_size: int
    eos_token_ids: frozenset[int] = frozenset()  # the tokens that end a completion
    llm: LLM | None = None  # the engine's LLM when it runs in this process (InprocClient), else None

    @property
    @abstractmethod
    def num_replicas(self) -> int:
        """Data-parallel replicas (1 in a thread)."""

    @abstractmethod
    def check_alive(self) -> None:
        """EngineDeadError if no replica can take a request."""

    @abstractmethod
    def add(self, request_id: str, prompt: str | None, prompt_ids: list[int], params: SamplingParams,
            stream, pin_key: str | None = None, media=None) -> concurrent.futures.Future:
        """Sends a tokenized request; the future settles when the core accepted it (the stream then gets its
        outputs) or refused it (RequestError, EngineSleepingError, EngineDeadError: the caller raises it).
        pin_key: a live session's; its requests go to one core, which keeps their blocks pinned (unpin)."""

    @abstractmethod
    def unpin(self, pin_key: str) -> None:
        """Gives back the blocks kept for pin_key (at the core's next turn); safe from any thread."""

    @abstractmethod
    def abort(self, request_id: str) -> None:
        """Stops a request (a no-op once it finished); safe from any thread."""

    @abstractmethod
    def call(self, method: str, *args, replicas: list[int] | None = None, **kwargs) -> list[concurrent.futures.Future]:
        """CoreService.call_<method> on the replicas (all by default), one future per replica."""

    @abstractmethod
    def compile_grammar(self, spec, field: str = "structured") -> None:
        """Compiles (and caches) an output constraint where the engine runs; RequestError if bad. Blocking."""

    @abstractmethod
    def stats(self) -> list[dict]:
        """Each replica's LLM.stats() (and sleep_level) as of its last turn: a snapshot, safe from any thread."""

    @abstractmethod
    def errors(self) -> list[BaseException | None]:
        """Each replica's reason for having stopped (EngineDeadError after shutdown), or None while it serves."""

    @abstractmethod
    def shutdown(self, timeout: float) -> None:
        """Stops the engine; requests in flight end with EngineDeadError."""

    def core_pids(self) -> list[int]:
        """The engine-core processes' ids (none in a thread)."""
        return []

    def served_per_replica(self) -> list[int]:
        """Requests routed to each replica so far (a thread has no router)."""
        return [0]

    def restart(self, index: int) -> None:
        """Starts a fresh engine core for a dead replica."""
        raise RuntimeError("an engine in a thread cannot be restarted: make a new AsyncLLM")
