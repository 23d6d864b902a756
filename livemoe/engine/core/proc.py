"""The engine-core process: one LLM (scheduler, block manager, runner, model) and the loop that takes the
client's commands off its socket, applies them between steps (CoreService, the one command protocol: service.py)
and sends what happened back.

    client --PUSH ipc--> [AddRequest | Abort | Call | Stop] --> CoreService --> llm.step() --PUSH ipc--> client

Only token ids, logprobs, finish reasons and metrics go out (the client detokenizes and streams), and
only as deltas: each output carries the tokens made since the last. A stop-string finish also carries
the core's cut text (the core detects stop strings, so it has it).
"""
import logging
import os
import time

from livemoe.engine.core import messages as m
from livemoe.engine.core.service import CoreService
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
    codec = m.Codec(receives=m.Command)
    try:
        llm = LLM(model_path, text_in_flight=False, **engine_kwargs)  # the client detokenizes
    except BaseException as e:  # noqa: BLE001 (reported to the client, which raises it)
        outbox.send(codec.encode(m.FailedToStart(e)))
        outbox.close()
        ctx.term()
        return
    service = CoreService(llm)
    outbox.send(codec.encode(m.Ready(llm.max_model_len, llm.config.block_size, os.getpid(), service.stats(),
                                         sorted(llm.core.eos_token_ids))))
    try:
        CoreLoop(service, inbox, outbox, codec, parent_pid).run()
    finally:
        service.close()
        llm.close()  # its tensor-parallel workers, if any
        inbox.close(0)
        outbox.close()
        ctx.term()


class CoreLoop:
    def __init__(self, service: CoreService | None, inbox, outbox, codec: m.Codec, parent_pid: int):
        self.service, self.inbox, self.outbox, self.codec, self.parent_pid = service, inbox, outbox, codec, parent_pid
        self.sent: dict[str, dict[int, int]] = {}  # request id -> completion index -> tokens sent
        self.last_stats: dict = {}

    def run(self) -> None:
        import zmq

        service = self.service
        assert service is not None  # None only where a test drives the burst window alone
        llm = service.llm
        apply_threads(llm.threads)
        poller = zmq.Poller()
        poller.register(self.inbox, zmq.POLLIN)
        while True:
            busy = llm.has_unfinished_requests()
            timeout = 0 if busy else (5 if service.busy() else IDLE_POLL_MS)
            if poller.poll(timeout):
                commands = self._drain()
                if not busy and any(isinstance(c, m.AddRequest) for c in commands):
                    commands += self._rest_of_burst(poller)
                for c in commands:
                    if isinstance(c, m.Abort):
                        for rid in c.request_ids:
                            self.sent.pop(rid, None)
                if not service.apply(commands):
                    break
            elif not busy and os.getppid() != self.parent_pid:
                log.error("the client process is gone; the engine core exits")
                break
            if not service.poll():
                break
            self._send(service.take())
            if llm.has_unfinished_requests():
                service.step()
                self._send(service.take())

    def _drain(self) -> list[m.Command]:
        import zmq

        commands: list[m.Command] = []
        while True:
            try:
                commands.append(self.codec.decode(self.inbox.recv(zmq.NOBLOCK)))
            except zmq.Again:
                return commands

    def _rest_of_burst(self, poller) -> list[m.Command]:
        """The commands that keep arriving, each within BURST_GAP_MS of the last, for up to BURST_MAX_MS."""
        commands: list[m.Command] = []
        deadline = time.monotonic() + BURST_MAX_MS / 1e3
        while True:
            left_ms = 1e3 * (deadline - time.monotonic())
            if left_ms <= 0 or not poller.poll(min(BURST_GAP_MS, left_ms)):
                return commands
            more = self._drain()
            commands += more
            if not all(isinstance(c, m.AddRequest) for c in more):  # a stop, an abort or a call: not kept waiting
                return commands

    def _send(self, events) -> None:
        """Sends what happened since the last message: the outputs first, then each call's return (what a call
        changed comes after the outputs before it). Nothing happened and the same stats: no message."""
        for rid in events.accepted:
            self.sent[rid] = {}
        for rid in events.failed:
            self.sent.pop(rid, None)
        deltas = [d for d in map(self._delta, events.outputs) if d is not None]
        assert self.service is not None  # run()'s
        stats = self.service.stats()
        if deltas or events.accepted or events.rejected or events.failed or stats != self.last_stats:
            # (an abort alone changes only the stats: they go out too, so callers see it idle)
            self.outbox.send(self.codec.encode(m.Outputs(deltas, events.accepted,
                                                         [m.Rejected(rid, e) for rid, e in events.rejected],
                                                         events.failed, stats)))
        for call_id, ok, result in events.returns:
            self.outbox.send(self.codec.encode(m.Return(call_id, ok, result, stats)))
        self.last_stats = stats

    def _delta(self, out) -> m.RequestDelta | None:
        sent = self.sent.get(out.request_id)
        if sent is None:
            return None  # aborted meanwhile
        # the prompt's logprobs go once, in the first delta that has them (key -1: sent)
        prompt_logprobs = None
        if out.prompt_logprobs is not None and -1 not in sent:
            prompt_logprobs = out.prompt_logprobs
            sent[-1] = 0
        completions = []
        for c in out.outputs:
            start = sent.get(c.index, 0)
            if start == len(c.token_ids) and c.finish_reason is None:
                continue
            sent[c.index] = len(c.token_ids)
            lps = None if c.logprobs is None else c.logprobs[start:]
            text = c.text if isinstance(c.stop_reason, str) else None  # a stop string cut the text
            routed = None if c.routed_experts is None else m.pickled(c.routed_experts)
            versions = None if c.weight_versions is None else c.weight_versions[start:]
            completions.append(m.CompletionDelta(c.index, c.token_ids[start:], lps, c.finish_reason, c.stop_reason,
                                                 text, routed, versions))
        if out.finished:
            del self.sent[out.request_id]
        return m.RequestDelta(out.request_id, completions, out.metrics if out.finished else None,
                              prompt_logprobs)
