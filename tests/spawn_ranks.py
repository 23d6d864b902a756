"""Runs a function on N gloo ranks in fresh processes, as torchrun would (RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR/PORT in the environment), with a timeout: a hung collective fails the test instead of blocking.

The function must be importable (top level of a module); each rank's return value comes back through a file.
"""
import multiprocessing as mp
import os
import tempfile
import time
import traceback

import torch

from livemoe.engine.net import free_port


def _entry(fn, rank: int, world_size: int, port: int, args: tuple, result_file: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)  # ranks share a small CPU
    try:
        result = {"ok": fn(*args)}
    except BaseException:  # noqa: BLE001  (the parent re-raises it with the rank's traceback)
        result = {"error": traceback.format_exc()}
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, result_file)


def spawn_ranks(fn, world_size: int, *args, timeout: float = 120.0) -> list:
    """fn(*args) on each of world_size ranks; returns their results in rank order. Raises with the first
    failing rank's traceback, or when a rank runs past `timeout` seconds (then every rank is killed)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory() as tmp:
        files = [os.path.join(tmp, f"rank{r}.pt") for r in range(world_size)]
        procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, args, files[r])) for r in range(world_size)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join()
        if hung:
            raise TimeoutError(f"ranks {hung} of {world_size} ran past {timeout}s (a hung collective?)")
        results = []
        for r, f in enumerate(files):
            if not os.path.exists(f):
                raise RuntimeError(f"rank {r} exited with code {procs[r].exitcode} and no result")
            res = torch.load(f, weights_only=False)
            if "error" in res:
                raise RuntimeError(f"rank {r} of {world_size} failed:\n{res['error']}")
            results.append(res["ok"])
        return results
