"""BackgroundServer: the HTTP server on a thread of the current process (a service or a trainer that
wants the OpenAI API beside its own work; the tests and the benchmark).

    with BackgroundServer(engine, "tiny") as server:   # port 0: a free port is chosen
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
"""
import socket
import threading
import time

import uvicorn

from engine.async_llm import AsyncLLM
from engine.server.app import build_app


class BackgroundServer:
    def __init__(self, engine: AsyncLLM, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning"):
        self.engine, self.host = engine, host
        self.port = port or _free_port(host)
        self.app = build_app(engine, model_name)
        config = uvicorn.Config(self.app, host=host, port=self.port, log_level=log_level, lifespan="off")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name="livemoe-http", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 30.0) -> "BackgroundServer":
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> "BackgroundServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
