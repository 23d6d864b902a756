"""The engine-core process: one LLM (scheduler, block manager, runner, model) and the loop that applies
the clients' commands between steps and sends each step's new tokens back.

    client --PUSH ipc--> [add | abort | call | stop] --> core loop --> llm.step() --PUSH ipc--> client

Only token ids, logprobs, finish reasons and metrics go out (the client detokenizes and streams), and
only as deltas: each output carries the tokens made since the last. A stop-string finish also carries
the core's cut text (the core detects stop strings, so it has it).

Commands other than add/abort are calls (`call`, a method name, its arguments): grammar compiles run on
a worker thread of the core (so a slow compile does not stall the steps) and answer when done; weight
updates, sleep and wake_up run on the loop between steps. With in_flight="finish", a weight update waits
until the requests in flight end (new requests wait behind it, so it cannot starve), then applies.
"""
import logging
import os
import queue
import time
from concurrent.futures import ThreadPoolExecutor

from livemoe.engine.core import messages as m
from livemoe.engine.errors import WorkerError
from livemoe.engine.decoder.config import apply_threads
from livemoe.engine.llm import LLM

log = logging.getLogger("livemoe.engine.core")

IDLE_POLL_MS = 1000  # while idle: how often the core checks that its client process is still there
# A burst of requests reaches an idle core over the time the API server takes to admit them (~0.3-1 ms
# each in Python: 32 take 10-30 ms). Stepping on the first one alone makes the rest wait for that step
# (a whole prefill on a real model), where a direct caller's burst is prefilled in one step. So an idle
# core that just got requests takes in those that follow within BURST_GAP_MS of each other, for at most
# BURST_MAX_MS, before its first step: a lone request waits BURST_GAP_MS more.
BURST_GAP_MS = 1
BURST_MAX_MS = 30
CALLS_ON_WORKER = {"compile_grammar"}  # no engine state touched: off the step loop


def run_core(model_path: str, engine_kwargs: dict, in_addr: str, out_addr: str, replica: int, parent_pid: int,
             log_level: int = logging.WARNING) -> None:
    """The process's entry point (multiprocessing spawn)."""
    import zmq

    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s core{replica} %(name)s: %(message)s")
    ctx = zmq.Context(1)
    inbox, outbox = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    inbox.connect(in_addr)
    outbox.connect(out_addr)
    outbox.setsockopt(zmq.LINGER, 2000)
    codec = m.Codec()
    try:
        llm = LLM(model_path, text_in_flight=False, **engine_kwargs)  # the client detokenizes
    except BaseException as e:  # noqa: BLE001 (reported to the client, which raises it)
        outbox.send(codec.encode([m.FAILED_TO_START, m.as_object(e)]))
        outbox.close()
        ctx.term()
        return
    outbox.send(codec.encode([m.READY, dict(max_model_len=llm.max_model_len, block_size=llm.config.block_size,
                                            pid=os.getpid(), stats=core_stats(llm))]))
    try:
        CoreLoop(llm, inbox, outbox, codec, parent_pid).run()
    finally:
        llm.close()  # its tensor-parallel workers, if any
        inbox.close(0)
        outbox.close()
        ctx.term()


class CoreLoop:
    def __init__(self, llm, inbox, outbox, codec: m.Codec, parent_pid: int):
        self.llm, self.inbox, self.outbox, self.codec, self.parent_pid = llm, inbox, outbox, codec, parent_pid
        self.sent: dict[str, dict[int, int]] = {}  # request id -> completion index -> tokens sent
        self.held: list[list] = []  # commands waiting behind a weight update that lets requests finish
        self.waiting_call: list | None = None  # that update
        self.worker = ThreadPoolExecutor(1, thread_name_prefix="livemoe-core-worker")
        self.worker_done: queue.SimpleQueue = queue.SimpleQueue()  # (call id, ok, result) from the worker
        self.worker_busy = 0
        self.accepted: list[str] = []
        self.rejected: list[list] = []  # [request id, error]
        self.failed: dict[str, str] = {}
        self.last_stats: dict = {}

    def run(self) -> None:
        import zmq

        apply_threads(self.llm.threads)
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        while True:
            busy = self.llm.has_unfinished_requests()
            timeout = 0 if busy else (5 if self.worker_busy or self.waiting_call else IDLE_POLL_MS)
            if poller.poll(timeout):
                commands = self._drain()
                if not busy and any(c[0] == m.ADD for c in commands):
                    commands += self._rest_of_burst(poller)
                if not self._apply(commands):
                    break
            elif not busy and os.getppid() != self.parent_pid:
                log.error("the client process is gone; the engine core exits")
                break
            self._return_worker_results()
            if self.waiting_call is not None and not self.llm.has_unfinished_requests():
                call, self.waiting_call = self.waiting_call, None
                self._call(call)
                held, self.held = self.held, []
                if not self._apply(held):
                    break
            self._flush([])
            if self.llm.has_unfinished_requests():
                self._step()
        self.worker.shutdown(wait=False, cancel_futures=True)

    def _drain(self) -> list[list]:
        import zmq

        commands = []
        while True:
            try:
                commands.append(self.codec.decode(self.inbox.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return commands

    def _rest_of_burst(self, poller) -> list[list]:
        """The commands that keep arriving, each within BURST_GAP_MS of the last, for up to BURST_MAX_MS."""
        commands, deadline = [], time.monotonic() + BURST_MAX_MS / 1e3
        while True:
            left_ms = 1e3 * (deadline - time.monotonic())
            if left_ms <= 0 or not poller.poll(min(BURST_GAP_MS, left_ms)):
                return commands
            more = self._drain()
            commands += more
            if any(c[0] != m.ADD for c in more):  # a stop, an abort or a call: not kept waiting
                return commands

    def _apply(self, commands: list[list]) -> bool:
        """Applies commands in order; False at stop."""
        for command in commands:
            kind = command[0]
            if kind == m.STOP:
                return False
            if self.waiting_call is not None and kind != m.ABORT:
                self.held.append(command)  # behind the weight update, in order
                continue
            if kind == m.ADD:
                self._add(*command[1:])
            elif kind == m.ABORT:
                for rid in command[1]:
                    self.held = [c for c in self.held if not (c[0] == m.ADD and c[1] == rid)]
                    self.sent.pop(rid, None)
                    self.llm.abort(rid)
            elif kind == m.CALL:
                self._call(command)
            else:
                raise AssertionError(f"unknown engine-core command {kind!r}")
        return True

    def _add(self, rid: str, prompt_ids: list[int], params) -> None:
        try:
            if self.llm.sleep_level:
                from livemoe.engine.errors import EngineSleepingError

                raise EngineSleepingError("the engine is asleep (wake_up() first)")
            self.llm.add_request(prompt_ids, params, rid)
        except Exception as e:  # noqa: BLE001 (RequestError for a bad request: the client raises it)
            self.rejected.append([rid, m.as_object(e)])
            return
        self.sent[rid] = {}
        self.accepted.append(rid)

    def _call(self, command: list) -> None:
        _, call_id, method, (args, kwargs) = command
        if method in CALLS_ON_WORKER:
            self.worker_busy += 1
            self.worker.submit(self._on_worker, call_id, method, args, kwargs)
            return
        if (method.startswith("update_weights") and kwargs.get("in_flight", "finish") == "finish"
                and self.llm.has_unfinished_requests()):
            self.waiting_call = command  # applied once the requests in flight have finished
            return
        try:
            result = getattr(self, "call_" + method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 (the caller raises it)
            self._return(call_id, False, e)
        else:
            self._return(call_id, True, result)

    def _on_worker(self, call_id, method, args, kwargs) -> None:
        try:
            result = getattr(self, "call_" + method)(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            self.worker_done.put((call_id, False, e))
        else:
            self.worker_done.put((call_id, True, result))

    def _return_worker_results(self) -> None:
        while not self.worker_done.empty():
            self.worker_busy -= 1
            self._return(*self.worker_done.get())

    def _return(self, call_id: int, ok: bool, result) -> None:
        self._flush([])  # what the call changed comes after the outputs before it
        self.last_stats = core_stats(self.llm)
        self.outbox.send(self.codec.encode([m.RETURN, call_id, ok, m.as_object(result), self.last_stats]))

    # -- calls --------------------------------------------------------------------------------------

    def call_compile_grammar(self, spec, field: str = "structured") -> None:
        self.llm.compile_grammar(spec, field)  # cached: the add that follows only looks it up

    def _aborting(self, fn):
        """Runs fn; requests it aborts in flight end with an error at their client."""
        try:
            return fn()
        finally:
            self.failed.update(self.llm.take_failed())

    def call_update_weights(self, named_tensors, in_flight: str = "finish") -> int:
        return self._aborting(lambda: self.llm.update_weights(named_tensors, in_flight="abort"))

    def call_update_weights_from_disk(self, model_path: str, in_flight: str = "finish") -> int:
        return self._aborting(lambda: self.llm.update_weights_from_disk(model_path, in_flight="abort"))

    def call_init_weights_update_group(self, **kw) -> None:
        from livemoe.engine.core.weight_sync import WeightReceiver

        self.llm.core.refuse_tensor_parallel("init_weights_update_group")
        self.receiver = WeightReceiver(**kw)

    def call_update_weights_from_distributed(self, names, dtypes, shapes, in_flight: str = "finish") -> int:
        receiver = getattr(self, "receiver", None)
        if receiver is None:
            raise RuntimeError("no weight-update group: POST /init_weights_update_group first")
        device = self.llm.core.runner.device
        tensors = receiver.receive(names, dtypes, shapes, device)
        return self.call_update_weights(tensors, in_flight)

    def call_sleep(self, level: int = 1) -> None:
        self._aborting(lambda: self.llm.sleep(level, in_flight="abort"))

    def call_wake_up(self) -> None:
        self.llm.wake_up()

    def call_reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    # -- steps --------------------------------------------------------------------------------------

    def _step(self) -> None:
        llm = self.llm
        try:
            outputs = llm.step()
        except WorkerError:  # a tensor-parallel worker is gone: this core cannot step any more (it exits)
            raise
        except Exception as e:  # noqa: BLE001 (a failed step: end what is in flight, keep serving)
            log.exception("engine step failed; aborting %d request(s)", len(llm.core.requests))
            for rid in list(llm.core.requests):
                llm.abort(rid)
                self.failed[rid] = f"engine step failed: {e!r}"
            outputs = []
        self.failed.update(llm.take_failed())
        self._flush(outputs)

    def _flush(self, outputs) -> None:
        """Sends what happened since the last message (nothing: no message)."""
        deltas = [d for d in map(self._delta, outputs) if d is not None]
        stats = core_stats(self.llm)
        if not (deltas or self.accepted or self.rejected or self.failed) and stats == self.last_stats:
            return  # (an abort alone changes only the stats: they go out too, so callers see it idle)
        self.last_stats = stats
        for rid in self.failed:
            self.sent.pop(rid, None)
        message = [m.OUTPUTS, deltas, self.accepted, self.rejected, self.failed, stats]
        self.accepted, self.rejected, self.failed = [], [], {}
        self.outbox.send(self.codec.encode(message))

    def _delta(self, out):
        sent = self.sent.get(out.request_id)
        if sent is None:
            return None  # aborted meanwhile
        completions = []
        for c in out.outputs:
            start = sent.get(c.index, 0)
            if start == len(c.token_ids) and c.finish_reason is None:
                continue
            sent[c.index] = len(c.token_ids)
            lps = None if c.logprobs is None else c.logprobs[start:]
            text = c.text if isinstance(c.stop_reason, str) else None  # a stop string cut the text
            completions.append([c.index, c.token_ids[start:], lps, c.finish_reason, c.stop_reason, text])
        metrics = None
        if out.finished:
            del self.sent[out.request_id]
            mt = out.metrics
            metrics = [mt.arrival_time, mt.first_token_time, mt.finish_time, mt.ttft, mt.tpot, mt.num_prompt_tokens,
                       mt.num_output_tokens, mt.num_cached_tokens, mt.num_preemptions, mt.decode_flops]
        return [out.request_id, completions, metrics]


def core_stats(llm) -> dict:
    return dict(llm.stats(), sleep_level=llm.sleep_level)
