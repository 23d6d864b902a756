"""The HTTP server beside other work: on a thread of this process (BackgroundServer: shares the
process's GIL with the caller), or as a child process running `livemoe serve` (ServerProcess:
its own GIL, as in a deployment).

    with BackgroundServer(engine, "tiny") as server:   # port 0: a free port is chosen
        client = OpenAI(base_url=server.url + "/v1", api_key="none")
    with ServerProcess(path, "tiny", ["--num-kv-blocks", "64"]) as server:
        ...
"""
import os
import subprocess
import sys
import threading
import time
import urllib.request

import uvicorn

from livemoe.engine.async_llm import AsyncLLM
from livemoe.engine.net import free_port
from livemoe.engine.server.app import build_app
from livemoe.engine.server.config import ServerConfig
from livemoe.engine.server.sockets import header_timeout_protocol


class BackgroundServer:
    def __init__(self, engine: AsyncLLM, model_name: str, host: str = "127.0.0.1", port: int = 0,
                 log_level: str = "warning", config: ServerConfig | None = None, reasoning_parser: str | None = None,
                 hot_routes: bool = True):
        self.engine, self.host = engine, host
        self.port = port or free_port(host)
        config = ServerConfig() if config is None else config
        self.app = build_app(engine, model_name, config, bind_host=host, reasoning_parser=reasoning_parser,
                             hot_routes=hot_routes)
        config = uvicorn.Config(self.app, host=host, port=self.port, log_level=log_level, lifespan="off",
                                http=header_timeout_protocol(config.header_timeout_s))
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


class ServerProcess:
    def __init__(self, model_path: str, model_name: str, options: list[str] = (), host: str = "127.0.0.1",
                 port: int = 0, env: dict | None = None, log_level: str = "warning"):
        self.host, self.port = host, port or free_port(host)
        self.args = [sys.executable, "-m", "livemoe.engine.server", "--model", str(model_path), "--served-model-name",
                     model_name, "--host", host, "--port", str(self.port), "--log-level", log_level, *options]
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 300.0) -> "ServerProcess":
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        self.proc = subprocess.Popen(self.args, cwd=root, env=self.env, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"livemoe.engine.server exited with {self.proc.returncode}:\n"
                                   f"{self.proc.stdout.read().decode()[-3000:]}")
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"livemoe.engine.server did not answer on {self.url}/health within {timeout}s")
            try:
                urllib.request.urlopen(self.url + "/health", timeout=2)
                return self
            except OSError:
                time.sleep(0.2)

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
