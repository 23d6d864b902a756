"""InprocClient, the EngineCoreClient of an engine in this process: one background thread owns the LLM and runs
its step loop (CoreService: the same command protocol as an engine-core process); every caller, on any event
loop, shares it.

Callers never touch the LLM: requests, aborts and calls are commands the engine thread applies between steps (so
the scheduler has one owner and needs no lock), and each step's outputs go back to the caller's event loop with
`call_soon_threadsafe` right after the step, the first token included. The forward pass runs off the event loop,
so a server stays responsive while the model computes.
"""
import concurrent.futures
import logging
import queue
import threading
from itertools import count

from livemoe.engine.core import messages as m
from livemoe.engine.core.client import EngineCoreClient
from livemoe.engine.core.delivery import deliver, settle
from livemoe.engine.core.service import CoreService
from livemoe.engine.decoder.config import apply_threads
from livemoe.engine.errors import EngineDeadError, EngineError
from livemoe.engine.llm import LLM

log = logging.getLogger(__name__)

BUSY_POLL_S = 0.005  # idle but for a call on the worker thread, or a weight update waiting: how often to look
PROCESS_ONLY = {  # what needs an engine-core process, and why
    "init_weights_update_group": "in a thread, share the trainer's module instead",
    "update_weights_from_distributed": "in a thread, share the trainer's module instead",
}


class InprocClient(EngineCoreClient):
    llm: LLM

    def __init__(self, llm: LLM, owns_llm: bool):
        """owns_llm: the client closes the LLM (its tensor-parallel workers) when its loop stops."""
        self.llm, self.owns_llm = llm, owns_llm
        self.tokenizer, self.max_model_len, self.block_size = llm.tokenizer, llm.max_model_len, llm.config.block_size
        self.eos_token_ids = frozenset(llm.core.eos_token_ids)
        self.service = CoreService(llm)
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.adding: dict[str, tuple] = {}  # request id -> (stream, accepted future): the engine thread's
        self.streams: dict = {}  # request id -> stream of an accepted request: the engine thread's
        self.calls: dict[int, concurrent.futures.Future] = {}
        self.call_ids = count()
        self.dead: BaseException | None = None
        self.snapshot = self.service.stats()
        self.thread = threading.Thread(target=self._run, name="livemoe-engine", daemon=True)
        self.thread.start()

    @property
    def num_replicas(self) -> int:
        return 1

    # -- the callers' side --------------------------------------------------------------------------

    def check_alive(self) -> None:
        if self.dead is not None:
            raise EngineDeadError(f"the engine loop has stopped: {self.dead}")

    def add(self, request_id, prompt, prompt_ids, params, stream, pin_key=None, media=None) -> concurrent.futures.Future:
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        self.check_alive()
        self.commands.put((m.AddRequest(request_id, prompt_ids, params, prompt, pin_key, media), stream, accepted))
        if not self.thread.is_alive():  # stopped meanwhile: nobody will apply the command
            settle(accepted, EngineDeadError(f"the engine loop has stopped: {self.dead}"))
        return accepted

    def abort(self, request_id: str) -> None:
        self.commands.put(m.Abort([request_id]))

    def unpin(self, pin_key: str) -> None:
        self.call("unpin", pin_key)

    def call(self, method: str, *args, replicas: list[int] | None = None, **kwargs) -> list[concurrent.futures.Future]:
        if method in PROCESS_ONLY:
            raise RuntimeError(f"{method} needs engine_core='process' ({PROCESS_ONLY[method]})")
        done: concurrent.futures.Future = concurrent.futures.Future()
        call_id = next(self.call_ids)
        self.calls[call_id] = done
        self.commands.put(m.Call(call_id, method, args, kwargs))
        if not self.thread.is_alive():
            settle(done, EngineDeadError(f"the engine loop has stopped: {self.dead}"))
        return [done]

    def compile_grammar(self, spec, field: str = "structured") -> None:
        self.llm.compile_grammar(spec, field)  # thread-safe (the compiler's lock): no trip through the loop

    def stats(self) -> list[dict]:
        return [dict(self.snapshot)]

    def errors(self) -> list[BaseException | None]:
        return [self.dead]

    def shutdown(self, timeout: float) -> None:
        if self.thread.is_alive():
            self.commands.put(m.Stop())
            self.thread.join(timeout)

    # -- the engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        service = self.service
        apply_threads(self.llm.threads)  # this thread's own OpenMP setting
        try:
            while True:
                commands = self._take_commands()
                if not service.apply(commands) or not service.poll():
                    break
                if commands or service.events:  # (a step's own publish follows: no snapshot of an idle turn)
                    self._publish()
                if self.llm.has_unfinished_requests():
                    service.step()
                    self._publish()
        except BaseException as e:  # noqa: BLE001 (the thread must report, whatever it was)
            log.exception("the engine loop died")
            self.dead = e
            self._fail_all(EngineDeadError(f"the engine loop died: {e!r}"))
            raise
        finally:
            service.close()
            if self.owns_llm:
                self.llm.close()  # its tensor-parallel workers stop with the loop
            if self.dead is None:
                self.dead = EngineDeadError("shut down")
                self._fail_all(EngineDeadError("the engine was shut down"))
            self.snapshot = service.stats()

    def _take_commands(self) -> list[m.Command]:
        """The queued commands (waiting for one when there is nothing to step); an add's stream and future are
        noted here."""
        commands: list[m.Command] = []
        try:
            if self.llm.has_unfinished_requests():
                item = self.commands.get_nowait()
            elif self.service.busy():  # a call on the worker thread: look again soon
                item = self.commands.get(timeout=BUSY_POLL_S)
            else:
                item = self.commands.get()
        except queue.Empty:
            return commands
        while True:
            if isinstance(item, tuple):  # (AddRequest, stream, accepted)
                add, stream, accepted = item
                self.adding[add.request_id] = (stream, accepted)
                item = add
            elif isinstance(item, m.Abort):
                for rid in item.request_ids:
                    self.streams.pop(rid, None)
                    if (entry := self.adding.pop(rid, None)) is not None:
                        settle(entry[1], EngineError(f"request {rid} was aborted"))
            commands.append(item)
            try:
                item = self.commands.get_nowait()
            except queue.Empty:
                return commands

    def _publish(self) -> None:
        """Hands what happened to the callers: adds accepted or refused, outputs, failed requests, call results."""
        events = self.service.take()
        self.snapshot = self.service.stats()  # before the outputs: a caller who saw its last one sees it done
        for rid in events.accepted:
            if (entry := self.adding.pop(rid, None)) is not None:  # (None: aborted in the same batch)
                self.streams[rid] = entry[0]
                entry[1].set_result(None)
        for rid, error in events.rejected:
            if (entry := self.adding.pop(rid, None)) is not None:
                settle(entry[1], error)
        items = []
        for out in events.outputs:
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue  # aborted meanwhile
            if out.finished:
                del self.streams[out.request_id]
            items.append((stream, out))
        deliver(items, self._unread)
        # the requests the engine ended alone: after their earlier outputs
        deliver([(stream, EngineError(f"request {rid} failed: {why}")) for rid, why in events.failed.items()
                 if (stream := self.streams.pop(rid, None)) is not None])
        for call_id, ok, result in events.returns:
            done = self.calls.pop(call_id)
            done.set_result(result) if ok else settle(done, result)

    def _unread(self, stream, out) -> None:
        if not out.finished:  # nobody will read it: stop computing it
            self.streams.pop(stream.request_id, None)
            self.llm.abort(stream.request_id)

    def _fail_all(self, error: BaseException) -> None:
        """Ends every stream, pending add and call (the loop stopped), and the adds still queued."""
        streams, self.streams = self.streams, {}
        for rid in streams:
            self.llm.abort(rid)
        deliver([(stream, error) for stream in streams.values()])
        adding, self.adding = self.adding, {}
        for _, accepted in adding.values():
            settle(accepted, error)
        for call_id in list(self.calls):
            settle(self.calls.pop(call_id), error)
        while True:
            try:
                item = self.commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, tuple):
                settle(item[2], EngineDeadError(f"the engine loop has stopped: {self.dead}"))
