"""One engine-core process of an MPClient and its two sockets (ipc://, in a directory only this user opens)."""
import logging
import multiprocessing
import os
import threading

from livemoe.engine.core import messages as m
from livemoe.engine.core.proc import run_core
from livemoe.engine.errors import EngineDeadError

log = logging.getLogger("livemoe.engine.core")


class Replica:
    """One core process and its sockets."""

    def __init__(self, index: int, ctx, ipc_dir: str, model_path: str, engine_kwargs: dict, env: dict, log_level,
                 generation: int = 0):
        import zmq

        self.index = index
        self.to_core, self.from_core = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
        in_addr, out_addr = f"ipc://{ipc_dir}/in{index}.{generation}", f"ipc://{ipc_dir}/out{index}.{generation}"
        self.to_core.bind(in_addr)
        self.from_core.bind(out_addr)
        self.to_core.setsockopt(zmq.LINGER, 0)
        self.from_core.setsockopt(zmq.LINGER, 0)
        spawn = multiprocessing.get_context("spawn")
        self.process = spawn.Process(target=run_core, name=f"livemoe-core{index}", daemon=True,
                                     args=(model_path, engine_kwargs, in_addr, out_addr, index, os.getpid(), log_level))
        with _ENV_LOCK:  # the child reads CUDA_VISIBLE_DEVICES at its first import of torch
            saved = {k: os.environ.get(k) for k in env}
            os.environ.update(env)
            try:
                self.process.start()
            finally:
                for k, v in saved.items():
                    if v is None:
                        os.environ.pop(k, None)
                    else:
                        os.environ[k] = v
        self.stats: dict = {}
        self.info: m.Ready | None = None  # once started
        self.error: BaseException | None = None
        self.reported = False  # its death was handled
        self.send_lock = threading.Lock()

    @property
    def alive(self) -> bool:
        return self.error is None

    def send(self, codec: m.Codec, message: m.Message) -> None:
        import zmq

        data = codec.encode(message)
        with self.send_lock:
            try:
                self.to_core.send(data)
            except zmq.ZMQError as e:  # closed by a shutdown meanwhile
                raise EngineDeadError(f"engine core {self.index}: {self.error or e}") from None

    def close(self, timeout: float) -> None:
        self.process.join(timeout)
        if self.process.is_alive():
            log.warning("engine core %d did not stop within %.0f s; terminating it", self.index, timeout)
            self.process.terminate()
            self.process.join(5)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(5)
        self.to_core.close(0)
        self.from_core.close(0)


_ENV_LOCK = threading.Lock()
