"""CoreService: the one command protocol of an engine core, over an LLM. Both cores drive it: the in-thread one
(livemoe/engine/core/inproc.py) and the process one (proc.py); they differ only in how commands arrive and
where what happened goes.

    apply([AddRequest | Abort | Call | Stop])  between steps, in order
    poll()                                    finished worker calls; a held weight update once nothing is in flight
    step()                                    one engine step; a failed step ends what is in flight, the core goes on
    take()                                    what happened since: accepted / rejected adds, outputs, failed requests,
                                              call results

Pins (live sessions, livemoe.engine.live): an AddRequest with a `pin_key` keeps its KV blocks pinned once it
finishes, one pin per key (the next request of that key takes them back from the prefix cache); the call `unpin`
gives them back.

Calls (`Call.method`, run as `call_<method>`): grammar compiles run on a worker thread (a slow compile does not
stall the steps) and answer when done; weight updates, sleep and wake_up run between steps. A weight update with
in_flight="finish" waits until the requests in flight end (the steps go on; commands after it wait behind it, so it
cannot starve), then applies; "interrupt" applies at once, the requests in flight resuming on the new weights.
"""
import logging
import queue
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from livemoe.engine.core import messages as m
from livemoe.engine.errors import EngineSleepingError, WorkerError
from livemoe.engine.outputs import RequestOutput

log = logging.getLogger("livemoe.engine.core")

CALLS_ON_WORKER = {"compile_grammar"}  # no engine state touched: off the step loop
COMPILE_THREADS = 4


@dataclass
class Events:
    accepted: list[str] = field(default_factory=list)
    rejected: list[tuple[str, BaseException]] = field(default_factory=list)
    outputs: list[RequestOutput] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)  # request id -> why the engine ended it
    returns: list[tuple[int, bool, Any]] = field(default_factory=list)  # (call id, ok, result or exception)

    def __bool__(self) -> bool:
        return bool(self.accepted or self.rejected or self.outputs or self.failed or self.returns)


class PinHolder:
    """What the block manager keeps a pin key's blocks in (BlockManager.pin_on_finish)."""

    __slots__ = ("pin",)

    def __init__(self):
        self.pin = None


class CoreService:
    def __init__(self, llm):
        self.llm = llm
        self.events = Events()
        self.held: list = []  # commands waiting behind a weight update that lets requests finish
        self.waiting_call: m.Call | None = None  # that update
        # a few threads: one slow grammar compile (it cannot be stopped) does not hold up the others
        self.worker = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="livemoe-core-worker")
        self.worker_done: queue.SimpleQueue = queue.SimpleQueue()  # (call id, ok, result) from the worker
        self.worker_busy = 0
        self.pins: dict[str, PinHolder] = {}  # pin key -> the blocks kept for it (AddRequest.pin_key)

    def busy(self) -> bool:
        """Whether the core has work without a new command: requests in flight, or calls to finish."""
        return self.llm.has_unfinished_requests() or bool(self.worker_busy) or self.waiting_call is not None

    def take(self) -> Events:
        events, self.events = self.events, Events()
        return events

    def stats(self) -> dict:
        return dict(self.llm.stats(), sleep_level=self.llm.sleep_level)

    def close(self) -> None:
        self.worker.shutdown(wait=False, cancel_futures=True)

    # -- commands -----------------------------------------------------------------------------------

    def apply(self, commands: list) -> bool:
        """Applies commands in order; False at a Stop."""
        for command in commands:
            if isinstance(command, m.Stop):
                return False
            if self.waiting_call is not None and not isinstance(command, m.Abort):
                self.held.append(command)  # behind the weight update, in order
            elif isinstance(command, m.AddRequest):
                self._add(command)
            elif isinstance(command, m.Abort):
                bm = self.llm.core.block_manager
                for rid in command.request_ids:
                    self.held = [c for c in self.held if not (isinstance(c, m.AddRequest) and c.request_id == rid)]
                    if bm is not None:
                        bm.cancel_pin_on_finish(rid)
                    self.llm.abort(rid)
            elif isinstance(command, m.Call):
                self._call(command)
            else:
                raise AssertionError(f"unknown engine-core command {command!r}")
        return True

    def poll(self) -> bool:
        """Returns the worker's finished calls; runs a held weight update once nothing is in flight, then the
        commands held behind it. False if one of those was a Stop."""
        while not self.worker_done.empty():
            self.worker_busy -= 1
            self.events.returns.append(self.worker_done.get())
        if self.waiting_call is not None and not self.llm.has_unfinished_requests():
            call, self.waiting_call = self.waiting_call, None
            self._call(call)
            held, self.held = self.held, []
            return self.apply(held)
        return True

    def _add(self, add: m.AddRequest) -> None:
        try:
            if self.llm.sleep_level:
                raise EngineSleepingError("the engine is asleep (wake_up() first)")
            self.llm.core.add_request(add.request_id, add.prompt, add.prompt_token_ids, add.params, media=add.media)
            if add.pin_key is not None:  # (the block manager exists: the add reserved the KV cache)
                holder = self.pins.setdefault(add.pin_key, PinHolder())
                self.llm.core.block_manager.pin_on_finish(add.request_id, holder)
        except Exception as e:  # noqa: BLE001 (RequestError for a bad request: the client raises it)
            self.events.rejected.append((add.request_id, e))
            return
        self.events.accepted.append(add.request_id)

    def _call(self, call: m.Call) -> None:
        if call.method in CALLS_ON_WORKER:
            self.worker_busy += 1
            self.worker.submit(self._on_worker, call)
            return
        if (call.method.startswith("update_weights") and call.kwargs.get("in_flight", "finish") == "finish"
                and self.llm.has_unfinished_requests()):
            self.waiting_call = call  # applied once the requests in flight have finished
            return
        self.events.returns.append(self._run_call(call))

    def _run_call(self, call: m.Call) -> tuple[int, bool, Any]:
        try:
            return call.call_id, True, getattr(self, "call_" + call.method)(*call.args, **call.kwargs)
        except Exception as e:  # noqa: BLE001 (the caller raises it)
            return call.call_id, False, e

    def _on_worker(self, call: m.Call) -> None:
        self.worker_done.put(self._run_call(call))

    # -- calls --------------------------------------------------------------------------------------

    def call_compile_grammar(self, spec, field: str = "structured") -> None:
        self.llm.compile_grammar(spec, field)  # cached: the add that follows only looks it up

    def _aborting(self, fn):
        """Runs fn; requests it aborts in flight end with an error at their client."""
        try:
            return fn()
        finally:
            self.events.failed.update(self.llm.take_failed())

    @staticmethod
    def _settle(in_flight: str) -> str:
        """What the engine does with requests still in flight: "finish" was held until none were (_call), so any
        left abort; "interrupt" resumes them on the new weights."""
        return "interrupt" if in_flight == "interrupt" else "abort"

    def call_update_weights(self, named_tensors, in_flight: str = "finish", weight_version: int | None = None) -> int:
        return self._aborting(lambda: self.llm.update_weights(named_tensors, self._settle(in_flight), weight_version))

    def call_update_weights_from_disk(self, model_path: str, in_flight: str = "finish",
                                      weight_version: int | None = None) -> int:
        return self._aborting(lambda: self.llm.update_weights_from_disk(model_path, self._settle(in_flight),
                                                                        weight_version))

    def call_init_weights_update_group(self, **group) -> None:
        self.llm.core.init_weights_update_group(**group)

    def call_update_weights_from_distributed(self, names, dtypes, shapes, in_flight: str = "finish",
                                             weight_version: int | None = None) -> int:
        # "interrupt" too (it was always "abort" here: a broadcast update never resumed the requests in flight)
        return self._aborting(lambda: self.llm.core.update_weights_from_distributed(
            names, dtypes, shapes, self._settle(in_flight), weight_version))

    def call_sleep(self, level: int = 1) -> None:
        self._aborting(lambda: self.llm.sleep(level, in_flight="abort"))

    def call_wake_up(self) -> None:
        self.llm.wake_up()

    def call_unpin(self, key: str) -> None:
        """Gives back the blocks kept for a pin key (a live session closed); a no-op for an unknown key."""
        holder = self.pins.pop(key, None)
        bm = self.llm.core.block_manager
        if holder is not None and bm is not None:
            bm.unpin(holder.pin)  # (a pin of a KV cache freed since, by sleep, is ignored)

    def call_reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    # -- steps --------------------------------------------------------------------------------------

    def step(self) -> None:
        llm = self.llm
        try:
            outputs = llm.step()
        except WorkerError:  # a tensor-parallel worker is gone: this core cannot step any more
            raise
        except Exception as e:  # noqa: BLE001 (a failed step: end what is in flight, keep serving)
            log.exception("engine step failed; aborting %d request(s)", len(llm.core.requests))
            for rid in list(llm.core.requests):
                llm.abort(rid)
                self.events.failed[rid] = f"engine step failed: {e!r}"
            outputs = []
        self.events.outputs += outputs
        self.events.failed.update(llm.take_failed())
