"""Tensor / expert-parallel decode over N processes: rank 0 is the process that holds the LLM (the caller's,
or the engine core's); it starts N-1 worker processes (livemoe/engine/decoder/worker.py), one per GPU with the
device index = rank (on a CPU, N processes over gloo). The scheduler, the block manager and the sampler run
on rank 0 only; each step rank 0 sends the step's plan (livemoe.engine.decoder.step_plan.StepPlan) to every worker and all
ranks run the forward together (the model's collectives inside it); only rank 0 samples.

    rank 0: schedule -> plan --zmq PUSH--> workers 1..N-1     (each: plan -> forward; logits dropped)
            plan -> forward -> logits -> sample                 (collectives among all N ranks)
            <--zmq PULL-- ready / KV blocks / errors of the workers

The plan goes over ZeroMQ (one PUSH socket per worker on 127.0.0.1), not a torch.distributed broadcast:
a worker waits for the next step for as long as the engine is idle (a collective would time out), and
wakes every POLL_MS to check that rank 0 still lives; the plan is two raw int arrays, no pickling, and
costs tens of microseconds a step on a CPU (bench/bench_tp.py). vLLM uses a shared-memory ring for the
same reason; ZeroMQ is already the engine core's transport.

Faults: a worker that raises reports the error (rank and cause) and exits; rank 0 checks for that after
every step and raises WorkerError naming the rank, stops the other workers, and fails from then on. The
torch.distributed group has a timeout (COLLECTIVE_TIMEOUT_S): a rank that stops inside a collective
ends the others' forward with an error, never a hang. Workers exit when rank 0 is gone.

`load_rank_model` and `check_parallel_sizes` are where the model side plugs in: the tensor-parallel
loader (each rank reads only its shards) and its divisibility check (heads, experts).

About 360 lines: rank 0's whole side of the worker protocol (start, plan, replies, faults, stop) in one place.
"""
import base64
import datetime
import logging
import os
import pickle
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import torch

from livemoe.engine.decoder.config import EngineConfig, resolve_max_model_len
from livemoe.engine.decoder.model_runner import ModelRunner
from livemoe.engine.errors import EngineConfigError, WorkerError
from livemoe.engine.model.config import load_config
from livemoe.engine.model.loader import load_model, resolve_device
from livemoe.engine.model.qwen3 import Qwen3ForCausalLM
from livemoe.engine.model.tensor_parallel import TensorParallel, check_tensor_parallel
from livemoe.engine.net import free_port

log = logging.getLogger("livemoe.engine.decoder.workers")

COLLECTIVE_TIMEOUT_S = 120.0  # a collective (or the rendezvous) that waits longer raises
START_TIMEOUT_S = 600.0  # workers loading a large checkpoint
POLL_MS = 200  # how often an idle worker checks that rank 0 lives
STOP_GRACE_S = 5.0  # a worker that does not exit after the stop message is terminated, then killed
FAULT_ENV = "LIVEMOE_WORKER_FAULT"  # tests: "RANK:STEP" makes that worker raise at that step

# commands from rank 0 (first frame of each message)
STEP, PROFILE, ALLOCATE, FREE, STOP = b"S", b"P", b"A", b"F", b"X"
# weight updates: join a trainer's group, stage an update (then answer), apply or drop what was staged
JOIN, STAGE, COMMIT, DISCARD = b"J", b"U", b"C", b"D"


def check_parallel_sizes(model_config, tensor_parallel_size: int, expert_parallel: bool, device: torch.device) -> None:
    """Everything that can be checked before a process starts (EngineConfigError naming the values):
    the model's divisibility by the ranks (heads; experts with EP) and the devices there are."""
    size = tensor_parallel_size
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if size > count:
            raise EngineConfigError(f"EngineConfig: tensor_parallel_size={size} needs {size} CUDA devices (one per "
                                    f"rank); {count} visible")
        if size > 1 and device.index not in (None, 0):
            raise EngineConfigError(f"EngineConfig: with tensor_parallel_size={size} rank r runs on cuda:r; device "
                                    f"{device} cannot be chosen (choose the GPUs with CUDA_VISIBLE_DEVICES)")
    elif device.type != "cpu":
        raise EngineConfigError(f"EngineConfig: tensor_parallel_size={size} runs on CUDA or CPU, not {device}")
    try:  # heads (and, with EP, experts; without, the MLP widths) must divide by the ranks
        check_tensor_parallel(model_config, size, expert_parallel)
    except ValueError as e:
        raise EngineConfigError(f"EngineConfig: {e}") from None


def load_rank_model(path: str, dtype, device: torch.device, rank: int, size: int, group, expert_parallel: bool):
    """Rank `rank`'s shard of the model (it reads only its slices of the checkpoint), whose forward runs its
    collectives over `group` and returns the full logits on every rank."""
    return load_model(path, dtype=dtype, device=device, tp=TensorParallel(rank, size, group, expert_parallel))


def rank_device(device: torch.device, rank: int) -> torch.device:
    return torch.device("cuda", rank) if device.type == "cuda" else torch.device("cpu")


def init_group(device: torch.device, rank: int, size: int, port: int) -> None:
    """The ranks' torch.distributed group (the default one: the model's collectives use it)."""
    import torch.distributed as dist

    backend = "cuda:nccl,cpu:gloo" if device.type == "cuda" else "gloo"
    kw: dict[str, Any] = {"device_id": torch.device("cuda", rank)} if device.type == "cuda" else {}
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S), **kw)


def exit_cause(returncode: int) -> str:
    if returncode < 0:
        return f"killed by {signal.Signals(-returncode).name}"
    return f"exited with code {returncode}"


class WorkerGroup:
    """Rank 0's side: starts the workers, joins their process group, sends them commands, watches them."""

    def __init__(self, model_path: str, dtype, device: torch.device, config: EngineConfig, max_model_len: int,
                 log_level: int = logging.WARNING):
        import torch.distributed as dist
        import zmq

        size = config.tensor_parallel_size
        if dist.is_initialized():
            raise EngineConfigError(f"EngineConfig: tensor_parallel_size={size} starts its own process group, and this "
                                    f"process is in one already: a torchrun job (use tensor_parallel_size=1 there), "
                                    f"or another engine with tensor_parallel_size > 1 (close() it first: one per "
                                    f"process)")
        self.size, self.device = size, device
        self.error: WorkerError | None = None
        self.closed = False
        self.inbox: list[tuple] = []  # (kind, rank, value) answers of the workers not yet collected
        self.ctx = zmq.Context(1)
        self.replies = self.ctx.socket(zmq.PULL)
        self.replies.setsockopt(zmq.LINGER, 0)
        reply_port = self.replies.bind_to_random_port("tcp://127.0.0.1")
        self.plans, self.procs = [], []
        port = free_port()
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        try:
            for rank in range(1, size):
                sock = self.ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.LINGER, 0)
                plan_port = sock.bind_to_random_port("tcp://127.0.0.1")
                self.plans.append(sock)
                args = dict(model_path=model_path, dtype=dtype, device=device, rank=rank, size=size,
                            dist_port=port, plan_addr=f"tcp://127.0.0.1:{plan_port}",
                            reply_addr=f"tcp://127.0.0.1:{reply_port}", parent_pid=os.getpid(), config=config,
                            max_model_len=max_model_len, log_level=log_level)
                blob = base64.b64encode(pickle.dumps(args)).decode()
                self.procs.append(subprocess.Popen([sys.executable, "-m", "livemoe.engine.decoder.worker", blob], env=env))
            self._rendezvous(device, port)
        except BaseException:
            self.close()
            raise

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def _rendezvous(self, device: torch.device, port: int) -> None:
        """Joins the process group as rank 0 while watching the workers (one that fails to start ends the
        wait at once, not after the timeout)."""
        failed: list[BaseException] = []

        def join():
            try:
                init_group(device, 0, self.size, port)
            except BaseException as e:  # noqa: BLE001 (raised below, on the caller's thread)
                failed.append(e)

        thread = threading.Thread(target=join, name="livemoe-tp-rendezvous", daemon=True)
        thread.start()
        while thread.is_alive():
            thread.join(0.05)
            self.check()
        if failed:
            self._fail(f"the process group of {self.size} ranks could not be formed: {failed[0]!r}")

    def wait_ready(self) -> None:
        """Waits until every worker has loaded its model."""
        self._collect("ready", START_TIMEOUT_S)

    # -- commands -----------------------------------------------------------------------------------

    def _send(self, frames: list) -> None:

        if self.closed and self.error is None:
            raise WorkerError("the tensor-parallel workers were stopped (LLM.close())")
        self.check()
        for sock in self.plans:
            self._send_one(sock, frames)

    def _send_one(self, sock, frames: list) -> None:
        import zmq

        # a PUSH socket whose worker is gone blocks: wait in slices, watching the workers
        while not sock.poll(100, zmq.POLLOUT):
            self.check()
        sock.send_multipart(frames, copy=False)

    def send_step(self, plan) -> None:
        self._send([STEP, *plan.frames()])

    def profile(self) -> None:
        self._send([PROFILE])

    def kv_blocks(self) -> list[int]:
        """The workers' answers to profile(): the KV blocks each could hold."""
        return self._collect("blocks", COLLECTIVE_TIMEOUT_S)

    def allocate(self, num_blocks: int) -> None:
        self._send([ALLOCATE, num_blocks.to_bytes(8, "little")])

    def free(self) -> None:
        if self.error is None and not self.closed:
            self._send([FREE])

    def join_weight_group(self, rank: int, group: dict) -> None:
        """Worker r joins a trainer's weight-update group as rank `rank` + r (answered by votes("joined"))."""
        for r, sock in enumerate(self.plans, start=1):
            self._send_one(sock, [JOIN, pickle.dumps(dict(group, rank=rank + r))])

    def stage(self, update) -> None:
        """Every worker stages its part of a WeightUpdate (answered by votes("staged"))."""
        self._send([STAGE, pickle.dumps(update)])

    def commit(self, apply: bool) -> None:
        self._send([COMMIT if apply else DISCARD])

    def votes(self, kind: str) -> BaseException | None:
        """The first worker's error among their answers to a join or stage, or None when all succeeded."""
        return next((e for e in self._collect(kind, START_TIMEOUT_S) if e is not None), None)

    # -- watching -----------------------------------------------------------------------------------

    def _collect(self, kind: str, timeout: float) -> list:
        """One `kind` message from each worker, in rank order (errors and deaths raise WorkerError)."""
        deadline = time.monotonic() + timeout
        while True:
            got = {rank: value for what, rank, value in self.inbox if what == kind}
            if len(got) == self.size - 1:
                self.inbox = [m for m in self.inbox if m[0] != kind]
                return [got[r] for r in range(1, self.size)]
            if time.monotonic() > deadline:
                missing = [r for r in range(1, self.size) if r not in got]
                self._fail(f"tensor-parallel worker rank(s) {missing} sent no {kind!r} within {timeout:.0f} s")
            self.replies.poll(50)
            self.check()

    def _receive(self) -> None:
        """Takes in the workers' messages that have arrived: errors raise, answers wait in the inbox (a
        worker may answer while rank 0 is still busy, e.g. ready before rank 0's rendezvous returned)."""
        import zmq

        while self.replies.poll(0):
            what, rank, value = self.replies.recv_pyobj(zmq.NOBLOCK)
            if what == "error":
                self._fail(f"tensor-parallel worker rank {rank} failed: {value}")
            self.inbox.append((what, rank, value))

    def check(self) -> None:
        """Raises WorkerError if a worker reported an error or exited (cheap: a poll and a waitpid each)."""
        if self.error is not None:
            raise self.error
        self._receive()
        for rank, proc in enumerate(self.procs, start=1):
            if proc.poll() is not None:
                if self.replies.poll(1000):  # its error report, sent before it exited
                    self._receive()
                self._fail(f"tensor-parallel worker rank {rank} (pid {proc.pid}) {exit_cause(proc.returncode)}")

    def explain(self, error: BaseException) -> WorkerError | None:
        """After rank 0's forward failed: the worker fault behind it, if any (a rank that died inside a
        collective makes the others' collective fail; its own report says why)."""
        try:
            deadline = time.monotonic() + 2.0
            while time.monotonic() < deadline:
                self.check()
                time.sleep(0.05)
        except WorkerError as e:
            return e
        return None

    def _fail(self, message: str) -> None:
        self.error = WorkerError(message)
        log.error("%s; stopping the other workers", message)
        self.close()
        raise self.error

    # -- shut-down ----------------------------------------------------------------------------------

    def close(self) -> None:
        """Stops every worker (the stop message, then SIGTERM, then SIGKILL) and leaves the process group.
        Idempotent; also called by LLM.close() and the LLM's finalizer."""
        if self.closed:
            return
        self.closed = True
        for sock in self.plans:
            try:
                sock.send_multipart([STOP], flags=1)  # zmq.NOBLOCK: a dead worker's queue may be full
            except Exception:  # noqa: BLE001
                pass
        deadline = time.monotonic() + STOP_GRACE_S
        for proc in self.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel worker pid %d did not stop; terminating it", proc.pid)
                proc.terminate()
                try:
                    proc.wait(2.0)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        for sock in self.plans:
            sock.close(0)
        self.replies.close(0)
        self.ctx.term()
        import torch.distributed as dist

        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 (a group whose peers died may not tear down cleanly)
                log.warning("tensor-parallel process group: teardown failed", exc_info=True)


def start_tensor_parallel(model_path: str, dtype, device,
                          config: EngineConfig) -> tuple[Qwen3ForCausalLM, "WorkerGroup"]:
    """Rank 0 of tensor_parallel_size ranks: checks what it can, starts the workers, loads its own shard while
    they load theirs; (rank 0's shard, the workers)."""
    import torch.distributed as dist

    mc = load_config(model_path)
    device = resolve_device(device)
    check_parallel_sizes(mc, config.tensor_parallel_size, config.enable_expert_parallel, device)
    workers = WorkerGroup(model_path, dtype, device, config, resolve_max_model_len(config, mc),
                          logging.getLogger().level)
    try:
        model = load_rank_model(model_path, dtype, rank_device(device, 0), 0, config.tensor_parallel_size,
                                dist.group.WORLD, config.enable_expert_parallel)
        workers.wait_ready()
    except BaseException:
        workers.close()
        raise
    return model, workers


class DriverRunner(ModelRunner):
    """Rank 0's ModelRunner: each step's plan, and each change of the KV cache, goes to the workers first,
    so every rank runs the same forward on its own cache."""

    def __init__(self, model, config: EngineConfig, max_model_len: int, workers: WorkerGroup):
        super().__init__(model, config, max_model_len)
        self.workers = workers

    def budget_num_blocks(self, extra_block_bytes: int = 0) -> int:
        """The smallest over the ranks (on a GPU each profiles its own memory, collectives included). A draft
        model runs whole on rank 0 (its few layers are cheaper than a collective per layer): only rank 0's blocks
        carry its cache's extra bytes."""
        self.workers.profile()
        mine = super().budget_num_blocks(extra_block_bytes)
        return min([mine, *self.workers.kv_blocks()])

    def allocate_kv_cache(self, num_blocks: int) -> None:
        self.workers.allocate(num_blocks)
        super().allocate_kv_cache(num_blocks)

    def free_kv_cache(self) -> None:
        self.workers.free()
        super().free_kv_cache()

    def routing_capture_refusal(self) -> str | None:
        # rank 0 alone would recapture its decode graphs (their collectives included) while the workers replay
        # theirs; before the first capture its graphs just hold the routing ops too (no extra collective)
        if self.graphs and not self.capture_routing:
            return ("return_routed_experts on a tensor-parallel CUDA engine must come with its first requests (the "
                    "ranks' decode graphs are captured together): start the engine again, or pass enforce_eager=True")
        return None

    def join_weight_group(self, **group) -> None:
        """Every rank joins: rank 0 as group["rank"], worker r as group["rank"] + r."""
        self.workers.join_weight_group(group["rank"], group)
        mine = None
        try:
            super().join_weight_group(**group)
        except Exception as e:  # noqa: BLE001 (raised once the workers have answered)
            mine = e
        theirs = self.workers.votes("joined")
        if mine is not None or theirs is not None:
            raise mine or theirs  # type: ignore[misc]

    def load_weights(self, update, tensors=None, refusal=None) -> int:
        """Every rank stages its part; all apply only if all staged (else every rank keeps its weights). A
        caller's tensors are checked here before the workers hear of the update, then broadcast to them."""
        import torch.distributed as dist

        from livemoe.engine.core.weight_sync import send_buckets

        staged, mine = None, None
        if tensors is not None:
            staged = self.stage_weights(update, tensors)
        self.workers.stage(update)
        if tensors is not None:
            send_buckets(dist.group.WORLD, tensors, self.device)
        else:
            try:
                staged = self.stage_weights(update)
            except Exception as e:  # noqa: BLE001 (raised once the workers have answered)
                mine = e
        theirs = self.workers.votes("staged")
        refused = mine or theirs or (RuntimeError(refusal) if refusal is not None else None)
        self.workers.commit(refused is None)
        if refused is not None:
            raise refused
        assert staged is not None
        return staged.apply()

    def run(self, out):
        plan = self.plan(out)
        self.workers.send_step(plan)
        try:
            logits = self.execute(plan)
        except Exception as e:
            cause = self.workers.explain(e)
            if cause is not None:
                raise cause from e
            raise
        self.workers.check()
        return logits, plan.sampling_seqs
