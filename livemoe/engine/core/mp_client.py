"""MPClient, the EngineCoreClient of engine-core processes: starts N of them (livemoe.engine.core.proc), routes
each request to one (livemoe.engine.core.router), turns the cores' token deltas back into cumulative
RequestOutputs for the streams (which detokenize: livemoe.engine.text.streaming.OutputDeltas), and forwards calls
(weight updates, sleep).

One reader thread receives from every core (zmq waits without the GIL) and hands each step's outputs
to the callers' event loops, as the in-thread core's loop does (inproc.py). Sends come from any thread, under a lock.

A core that dies (its process exits, or is killed) ends its requests and calls with EngineDeadError at
once: the reader checks the processes whenever no message came for POLL_MS. `on_death` (the server's
policy: exit, or restart the replica) is called on the reader thread.

About 370 lines: the client side of the engine-core processes (start, restart, route, read, assemble deltas,
fail what a dead core held) shares one lock and one table of requests, so it stays one class.
"""
import concurrent.futures
import logging
import queue
import shutil
import tempfile
import threading
import time
from itertools import count
from typing import cast

from livemoe.engine.core import messages as m
from livemoe.engine.core.client import EngineCoreClient
from livemoe.engine.core.delivery import deliver, settle
from livemoe.engine.core.replica import Replica
from livemoe.engine.core.router import Router
from livemoe.engine.decoder.output_processor import final_text
from livemoe.engine.errors import CoreDeadError, EngineDeadError, EngineError, RequestError
from livemoe.engine.outputs import CompletionOutput, RequestOutput

log = logging.getLogger("livemoe.engine.core")

MSGPACK_INT_MIN, MSGPACK_INT_MAX = -(2**63), 2**64 - 1  # the integers a msgpack frame holds
POLL_MS = 100  # the longest a dead core goes unnoticed
START_TIMEOUT_S = 600.0  # loading a large checkpoint


class Tracked:
    """A request in flight: its replica, its stream, and its cumulative output."""

    __slots__ = ("replica", "stream", "params", "output", "accepted")

    def __init__(self, replica: int, stream, params, output: RequestOutput, accepted: concurrent.futures.Future):
        self.replica, self.stream, self.params, self.output, self.accepted = replica, stream, params, output, accepted


class MPClient(EngineCoreClient):
    def __init__(self, model_path: str, engine_kwargs: dict, tokenizer, num_replicas: int = 1,
                 devices: list[str] | None = None, on_death=None, log_level: int = logging.WARNING):
        import zmq

        if num_replicas < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {num_replicas}")
        self.model_path, self.engine_kwargs, self.tokenizer = model_path, engine_kwargs, tokenizer
        self.devices, self.on_death, self.log_level = devices, on_death, log_level
        self.codec = m.Codec(receives=m.Reply)  # the reader thread's (decode)
        self.send_codec = m.Codec(receives=m.Reply)
        self.ctx = zmq.Context(1)
        self.ipc_dir = tempfile.mkdtemp(prefix="livemoe-core-")  # 0700: only this user reaches the sockets
        self.replicas: list[Replica] = []
        self.tracked: dict[str, Tracked] = {}
        self.calls: dict[int, tuple[int, concurrent.futures.Future]] = {}
        self.call_ids = count()
        self.lock = threading.Lock()  # tracked, calls and the router, between callers and the reader
        self.stopping = False
        self.restarts: queue.SimpleQueue = queue.SimpleQueue()  # replicas the reader thread is to restart
        self.generations = [0] * num_replicas
        self.pinned: dict[str, int] = {}  # pin key -> the replica that keeps its blocks
        try:
            for i in range(num_replicas):
                self.replicas.append(self._spawn(i))
            for r in self.replicas:
                self._wait_ready(r)
        except BaseException:
            self._close_all(timeout=5)
            raise
        info = self.replicas[0].info
        assert info is not None  # _wait_ready raised otherwise
        self.max_model_len, self.block_size = info.max_model_len, info.block_size
        self.eos_token_ids = frozenset(info.eos_token_ids)
        self.router = Router(num_replicas, self.block_size)
        self.reader = threading.Thread(target=self._read, name="livemoe-core-reader", daemon=True)
        self.reader.start()

    def _spawn(self, i: int) -> Replica:
        env = {}
        if self.devices is not None:
            env["CUDA_VISIBLE_DEVICES"] = self.devices[i]
        return Replica(i, self.ctx, self.ipc_dir, self.model_path, self.engine_kwargs, env, self.log_level,
                       self.generations[i])

    def _wait_ready(self, r: Replica) -> None:
        import zmq

        deadline = time.monotonic() + START_TIMEOUT_S
        while not r.from_core.poll(POLL_MS, zmq.POLLIN):
            if not r.process.is_alive():
                raise CoreDeadError(f"engine core {r.index} exited while starting (exit code {r.process.exitcode})")
            if time.monotonic() > deadline:
                raise CoreDeadError(f"engine core {r.index} did not start within {START_TIMEOUT_S:.0f} s")
        self._started(r, self.codec.decode(r.from_core.recv()))
        if r.error is not None:
            raise r.error  # the core's own error (a bad option or checkpoint: its message says what)

    @staticmethod
    def _started(r: Replica, message: m.Ready | m.FailedToStart) -> None:
        if isinstance(message, m.FailedToStart):
            r.error = message.error
            return
        assert isinstance(message, m.Ready), message
        r.info, r.stats, r.error = message, message.stats, None

    # -- the callers' side --------------------------------------------------------------------------

    @property
    def alive(self) -> list[bool]:
        return [r.alive for r in self.replicas]

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def check_alive(self) -> None:
        if self.stopping or not any(self.alive):
            raise EngineDeadError(f"every engine core has stopped: {self.replicas[0].error}")

    def add(self, request_id: str, prompt_text, prompt_ids: list[int], params, stream,
            pin_key: str | None = None, media=None) -> concurrent.futures.Future:
        """Sends a request to a replica (a pin key's replica while it lives); the future settles when the core
        accepted or refused it."""
        # the core validates against the vocabulary; what AddRequest's list[int] cannot carry (a bool or a float
        # would fail the core's decoding, a huge int the encoder) is refused here
        unsendable = [t for t in prompt_ids if type(t) is not int or not MSGPACK_INT_MIN <= t <= MSGPACK_INT_MAX]
        if unsendable:
            raise RequestError(f"prompt token ids must be integers in the vocabulary; got {unsendable[:5]}")
        accepted: concurrent.futures.Future = concurrent.futures.Future()
        with self.lock:
            if request_id in self.tracked:
                raise RequestError(f"request id {request_id!r} is already in flight")
            alive = self.alive
            if not any(alive) or self.stopping:
                raise EngineDeadError(f"every engine core has stopped: {self.replicas[0].error}")
            r = self.pinned.get(pin_key, -1) if pin_key is not None else -1
            if r < 0 or not alive[r]:
                r = self.router.pick(prompt_ids, alive)
            while not self.replicas[r].process.is_alive():  # died since the reader last looked (it reports it)
                alive[r] = False
                if not any(alive):
                    raise EngineDeadError(f"every engine core has stopped (engine core {r} just died)")
                r = self.router.pick(prompt_ids, alive)
            if pin_key is not None:
                self.pinned[pin_key] = r
            output = RequestOutput(request_id, prompt_text, prompt_ids, [CompletionOutput(i, "", [], None, None, None)
                                                                        for i in range(params.n)], False)
            self.tracked[request_id] = Tracked(r, stream, params, output, accepted)
            self.router.add(request_id, r, prompt_ids, len(prompt_ids) + params.n * params.max_tokens)
            # sent under the lock, so an abort from another thread cannot overtake it
            # media (PlacedMedia with their tensors) go as one pickle: msgpack would turn the dataclasses into dicts
            self.replicas[r].send(self.send_codec, m.AddRequest(request_id, prompt_ids, params, None, pin_key,
                                                                m.pickled(media) if media else None))
        return accepted

    def abort(self, request_id: str) -> None:
        with self.lock:
            t = self.tracked.pop(request_id, None)
            self.router.remove(request_id)
            if t is not None and self.replicas[t.replica].alive:
                try:
                    self.replicas[t.replica].send(self.send_codec, m.Abort([request_id]))
                except RuntimeError:  # EngineDeadError: a core that is gone has nothing to abort
                    pass

    def unpin(self, pin_key: str) -> None:
        with self.lock:
            r = self.pinned.pop(pin_key, None)
        if r is not None and self.replicas[r].alive:
            try:
                self.call("unpin", pin_key, replicas=[r])
            except RuntimeError:  # EngineDeadError: gone meanwhile, and its pins with it
                pass

    def call(self, method: str, *args, replicas: list[int] | None = None, **kwargs) -> list[concurrent.futures.Future]:
        """Calls CoreLoop.call_<method> on the replicas (all by default); one future per replica."""
        futures = []
        for i in range(len(self.replicas)) if replicas is None else replicas:
            r = self.replicas[i]
            future: concurrent.futures.Future = concurrent.futures.Future()
            futures.append(future)
            if not r.alive:
                future.set_exception(EngineDeadError(f"engine core {i} has stopped: {r.error}"))
                continue
            with self.lock:
                call_id = next(self.call_ids)
                self.calls[call_id] = (i, future)
            r.send(self.send_codec, m.Call(call_id, method, m.pickled(args), m.pickled(kwargs)))
        return futures

    def stats(self) -> list[dict]:
        return [dict(r.stats) for r in self.replicas]

    def errors(self) -> list[BaseException | None]:
        return [r.error for r in self.replicas]

    def core_pids(self) -> list[int]:
        return cast(list[int], [r.process.pid for r in self.replicas])  # started in Replica(): each has its pid

    def served_per_replica(self) -> list[int]:
        return list(self.router.served)

    def compile_grammar(self, spec, field: str = "structured") -> None:
        for f in self.call("compile_grammar", spec, field):
            f.result()

    def shutdown(self, timeout: float = 10.0) -> None:
        if self.stopping:
            return
        self.stopping = True
        for r in self.replicas:
            if r.alive:
                try:
                    r.send(self.send_codec, m.Stop())
                except Exception:  # noqa: BLE001 (a socket already gone)
                    pass
        error = EngineDeadError("the engine was shut down")
        with self.lock:  # no send after this: the sockets close
            for r in self.replicas:
                r.error = r.error or error
        self.reader.join(timeout)
        self._close_all(timeout)
        self._fail_replicas(range(len(self.replicas)), error)

    def _close_all(self, timeout: float) -> None:
        for r in self.replicas:
            r.close(timeout)
        self.ctx.term()
        shutil.rmtree(self.ipc_dir, ignore_errors=True)

    # -- the reader thread ----------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            self._read_loop()
        except BaseException as e:  # noqa: BLE001 (a bug here must not leave callers waiting forever)

            log.exception("the engine client's reader thread failed")
            error = EngineDeadError(f"the engine client failed: {e!r}")
            for r in self.replicas:
                r.error = r.error or error
            self._fail_replicas(range(len(self.replicas)), error)
            if self.on_death is not None:
                self.on_death(-1, error)

    def _read_loop(self) -> None:
        import zmq

        poller = zmq.Poller()
        sockets = {}
        for r in self.replicas:
            poller.register(r.from_core, zmq.POLLIN)
            sockets[r.from_core] = r
        last_check = time.monotonic()
        while not self.stopping:
            while not self.restarts.empty():
                self._restart_now(self.restarts.get(), poller, sockets)
            try:
                ready = poller.poll(POLL_MS)
            except zmq.ZMQError:  # the context was closed by shutdown
                return
            for sock, _ in ready:
                r = sockets[sock]
                while True:
                    try:
                        data = sock.recv(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    except zmq.ZMQError:
                        return
                    message = self.codec.decode(data)
                    if isinstance(message, (m.Ready, m.FailedToStart)):  # a restarted core
                        self._started(r, message)
                        log.warning("engine core %d restarted: %s", r.index, r.error or "ready")
                    else:
                        self._dispatch(r, message)
            if time.monotonic() - last_check >= POLL_MS / 1000:  # also under a stream of messages from others
                last_check = time.monotonic()
                self._check_processes()

    def _check_processes(self) -> None:
        for r in self.replicas:
            if not r.process.is_alive() and not self.stopping and not r.reported:
                r.reported = True
                r.error = EngineDeadError(f"engine core {r.index} (pid {r.process.pid}) died with exit code "
                                          f"{r.process.exitcode}")
                log.error("%s; failing its requests", r.error)
                self._fail_replicas([r.index], r.error)
                if self.on_death is not None:
                    self.on_death(r.index, r.error)

    def restart(self, index: int) -> None:
        """Starts a fresh core for a dead replica (the server's restart policy); it serves once ready."""
        self.restarts.put(index)

    def _restart_now(self, index: int, poller, sockets) -> None:
        old = self.replicas[index]
        if old.alive:
            return
        poller.unregister(old.from_core)
        del sockets[old.from_core]
        old.close(timeout=5)
        self.generations[index] += 1
        new = self._spawn(index)
        new.error = EngineDeadError(f"engine core {index} is restarting")
        self.replicas[index] = new
        poller.register(new.from_core, 1)  # zmq.POLLIN
        sockets[new.from_core] = new

    def _fail_replicas(self, indices, error: BaseException) -> None:
        indices = set(indices)
        with self.lock:
            doomed = [(rid, t) for rid, t in self.tracked.items() if t.replica in indices]
            for rid, _ in doomed:
                del self.tracked[rid]
                self.router.remove(rid)
            calls = [(cid, f) for cid, (i, f) in self.calls.items() if i in indices]
            for cid, _ in calls:
                del self.calls[cid]
        for i in indices:
            self.router.forget(i)
        for _, t in doomed:
            settle(t.accepted, error)
        deliver([(t.stream, error) for _, t in doomed])
        for _, f in calls:
            settle(f, error)

    def _dispatch(self, r: Replica, message: m.Outputs | m.Return) -> None:
        if isinstance(message, m.Outputs):
            r.stats = message.stats
            self._on_outputs(message)
        elif isinstance(message, m.Return):
            r.stats = message.stats
            with self.lock:
                entry = self.calls.pop(message.call_id, None)
            if entry is not None:
                entry[1].set_result(message.result) if message.ok else settle(entry[1], message.result)
        else:
            raise AssertionError(f"unknown engine-core message {message!r}")

    def _on_outputs(self, message: m.Outputs) -> None:
        with self.lock:
            for rid in message.accepted:
                t = self.tracked.get(rid)
                if t is not None and not t.accepted.done():
                    t.accepted.set_result(None)
            for rejected in message.rejected:
                rid, error = rejected.request_id, rejected.error
                t = self.tracked.pop(rid, None)
                self.router.remove(rid)
                if t is not None:
                    settle(t.accepted, error)
            updates, ended = [], []
            for delta in message.deltas:
                rid = delta.request_id
                t = self.tracked.get(rid)
                if t is None:
                    continue  # aborted meanwhile
                new_tokens = self._apply_delta(t, delta)
                self.router.progress(rid, new_tokens)
                if delta.metrics is not None:
                    del self.tracked[rid]
                    self.router.remove(rid)
                updates.append((t.stream, _snapshot(t.output)))
            for rid, why in message.failed.items():
                t = self.tracked.pop(rid, None)
                self.router.remove(rid)
                if t is not None:
                    ended.append((t.stream, EngineError(f"request {rid} failed: {why}")))
                    settle(t.accepted, EngineError(f"request {rid} failed: {why}"))
        deliver(updates + ended, lambda stream, _: self.abort(stream.request_id))  # a closed loop: nobody reads

    def _apply_delta(self, t: Tracked, delta: m.RequestDelta) -> int:
        out, new_tokens = t.output, 0
        for d in delta.completions:
            c = out.outputs[d.index]
            c.token_ids.extend(d.token_ids)
            new_tokens += len(d.token_ids)
            if d.logprobs is not None:
                c.logprobs = (c.logprobs or []) + d.logprobs
            if d.weight_versions is not None:
                c.weight_versions = (c.weight_versions or []) + d.weight_versions
            if d.finish_reason is not None:
                c.finish_reason, c.stop_reason, c.routed_experts = d.finish_reason, d.stop_reason, d.routed_experts
                c.text = d.text if d.text is not None else final_text(self.tokenizer, c.token_ids, d.finish_reason,
                                                                      d.stop_reason, t.params.skip_special_tokens)
        if delta.prompt_logprobs is not None:
            out.prompt_logprobs = delta.prompt_logprobs
        if delta.metrics is not None:
            out.finished = True
            out.metrics = delta.metrics
        return new_tokens


def _snapshot(out: RequestOutput) -> RequestOutput:
    """What OutputDeltas reads, frozen at this step (the lists keep growing on the reader thread)."""
    return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids,
                         [CompletionOutput(c.index, c.text, c.token_ids[:], c.finish_reason, c.stop_reason,
                                           None if c.logprobs is None else c.logprobs[:],
                                           routed_experts=c.routed_experts,
                                           weight_versions=None if c.weight_versions is None else c.weight_versions[:])
                          for c in out.outputs],
                         out.finished, out.metrics, out.prompt_logprobs)
