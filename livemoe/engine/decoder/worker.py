"""A tensor-parallel worker process (rank >= 1; started by livemoe.engine.decoder.workers.WorkerGroup as
`python -m livemoe.engine.decoder.worker ARGS`): joins the ranks' process group, loads its rank's model, then
runs what rank 0 sends — each step's forward (its logits are dropped: rank 0 samples), KV-cache sizing,
allocation and release — until told to stop or rank 0 is gone. Any error is reported to rank 0 (rank and
cause) before the process exits with code 1."""
import base64
import logging
import os
import pickle
import sys
import traceback

from livemoe.engine.decoder.config import DEFAULT_THREADS, apply_threads
from livemoe.engine.decoder.model_runner import ModelRunner
from livemoe.engine.decoder.step_plan import StepPlan
from livemoe.engine.errors import CheckpointError
from livemoe.engine.decoder.workers import (ALLOCATE, COMMIT, DISCARD, FAULT_ENV, FREE, JOIN, POLL_MS, PROFILE,
                                            STAGE, STEP, STOP, init_group, load_rank_model, rank_device)

log = logging.getLogger("livemoe.engine.decoder.workers")


def run_worker(model_path, dtype, device, rank: int, size: int, dist_port: int, plan_addr: str, reply_addr: str,
               parent_pid: int, config, max_model_len: int, log_level: int) -> int:
    import zmq

    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    ctx = zmq.Context(1)
    plans, replies = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    plans.connect(plan_addr)
    replies.connect(reply_addr)
    replies.setsockopt(zmq.LINGER, 5000)  # the error report must get out before the process ends
    code = 0
    try:
        serve(rank, size, model_path, dtype, device, dist_port, plans, replies, parent_pid, config, max_model_len)
    except BaseException as e:  # noqa: BLE001 (reported to rank 0, which raises it)
        log.error("failed: %r", e)
        replies.send_pyobj(("error", rank, f"{e!r}\n{traceback.format_exc(limit=-4)}"))
        code = 1
    finally:
        import torch.distributed as dist

        plans.close(0)
        replies.close()
        ctx.term()
        if dist.is_initialized() and code == 0:
            dist.destroy_process_group()
    return code


def serve(rank, size, model_path, dtype, device, dist_port, plans, replies, parent_pid, config, max_model_len):
    import torch

    apply_threads(DEFAULT_THREADS if config.threads is None else config.threads)
    my_device = rank_device(device, rank)
    if my_device.type == "cuda":
        torch.cuda.set_device(my_device)
    init_group(device, rank, size, dist_port)
    import torch.distributed as dist

    model = load_rank_model(model_path, dtype, my_device, rank, size, dist.group.WORLD,
                            config.enable_expert_parallel)
    runner = ModelRunner(model, config, max_model_len)
    replies.send_pyobj(("ready", rank, os.getpid()))
    fault = os.environ.get(FAULT_ENV, "")
    fault_step = int(fault.split(":")[1]) if fault.split(":")[0] == str(rank) else -1
    steps = 0
    staged = None  # a weight update staged, waiting for rank 0's COMMIT or DISCARD
    while True:
        if not plans.poll(POLL_MS):
            if os.getppid() != parent_pid:
                log.error("rank 0 (pid %d) is gone; exiting", parent_pid)
                return
            continue
        frames = plans.recv_multipart(copy=False)
        kind = frames[0].bytes
        if kind == STEP:
            if steps == fault_step:
                raise RuntimeError(f"injected fault ({FAULT_ENV}) at step {steps}")
            runner.execute(StepPlan.from_frames([f.buffer for f in frames[1:]]))
            steps += 1
        elif kind == PROFILE:
            replies.send_pyobj(("blocks", rank, runner.budget_num_blocks()))
        elif kind == ALLOCATE:
            runner.allocate_kv_cache(int.from_bytes(frames[1].bytes, "little"))
        elif kind == FREE:
            runner.free_kv_cache()
        elif kind == JOIN:
            group = pickle.loads(frames[1].bytes)
            replies.send_pyobj(("joined", rank, portable(attempt(lambda: runner.join_weight_group(**group)), rank)))
        elif kind == STAGE:
            staged, error = None, None
            try:
                staged = runner.stage_weights(pickle.loads(frames[1].bytes))
            except Exception as e:  # noqa: BLE001 (rank 0 raises it, and no rank applies the update)
                error = e
            replies.send_pyobj(("staged", rank, portable(error, rank)))
        elif kind in (COMMIT, DISCARD):
            if kind == COMMIT:
                assert staged is not None, "COMMIT without a staged update"
                staged.apply()
            staged = None
        elif kind == STOP:
            return
        else:
            raise AssertionError(f"unknown command {kind!r} from rank 0")


def attempt(fn) -> BaseException | None:
    """None when fn() succeeds, else its exception (sent to rank 0, which raises it)."""
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return e
    return None


def portable(error: BaseException | None, rank: int) -> BaseException | None:
    """An error rank 0 can unpickle and raise: a CheckpointError as it is (its message names the tensor),
    anything else as a RuntimeError naming the rank and the cause."""
    if error is None or type(error) is CheckpointError:
        return error
    return RuntimeError(f"tensor-parallel worker rank {rank}: {error!r}")


if __name__ == "__main__":
    sys.exit(run_worker(**pickle.loads(base64.b64decode(sys.argv[1]))))
