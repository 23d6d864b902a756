"""`livemoe serve --model PATH [--host 127.0.0.1] [--port 8000] [engine options] [server options]`:
the OpenAI-compatible server (livemoe/engine/server/) over one AsyncLLM, run by uvicorn.

Engine options are EngineConfig's fields as flags (`--max-num-seqs 64`, `--threads 1`,
`--no-enable-prefix-caching`), server options ServerConfig's (`--max-n 16`, `--max-body-bytes 1048576`,
`--api-key KEY`, `--allowed-hosts a.example,b.example`, `--enable-docs`); those not given keep the
dataclasses' defaults. The API key may also come from the LIVEMOE_API_KEY environment variable (a flag
shows in `ps`; the variable does not). `--dtype` and `--device` choose how the weights load.

The engine runs in its own process (`--engine-core process`, the default; livemoe/engine/core/), or
`--data-parallel-size N` of them behind this one server (one GPU each, CUDA_VISIBLE_DEVICES split; on a
CPU, N processes). A core that dies ends its requests with an error and turns /health to 503; new requests go
to the replicas alive at once (they fail only when none is). Then `--on-core-death exit` (the default with one
replica) stops the server with exit code 1 (a supervisor restarts it), and `restart` (the default with several)
starts a fresh core for that replica while the others serve. `--engine-core thread` keeps the engine in the server's
process (one interpreter lock for both: slower under load).

`--tensor-parallel-size N [--enable-expert-parallel]` splits the model over N processes, one per GPU: the
engine core is rank 0 and starts the other N-1 (livemoe/engine/decoder/workers.py); SIGTERM stops them all.
With `--data-parallel-size D` each of the D replicas takes N GPUs.
"""
import argparse
import logging
import os
import signal
import sys
import threading
from dataclasses import MISSING, fields
from typing import get_args

from livemoe.engine.decoder.config import DEFAULT_THREADS, EngineConfig
from livemoe.engine.server.config import ServerConfig

SKIPPED_OPTIONS = {"use_tqdm"}  # meaningless for a server
API_KEY_ENV = "LIVEMOE_API_KEY"
# what a field's None default means for a server (its help would say "default: None")
NONE_MEANS = {
    "threads": f"{DEFAULT_THREADS} (torch CPU threads; 0 keeps torch's own choice)",
    "max_model_len": "the model's max_position_embeddings",
    "num_kv_blocks": "sized by --kv-cache-bytes (CPU) or --gpu-memory-utilization (GPU)",
    "api_key": f"none (or the {API_KEY_ENV} environment variable)",
    "allowed_hosts": "loopback names when bound to loopback, else any",
    "allowed_local_media_path": "none (media content parts as data URLs only)",
    "speculative_config": 'off (JSON: {"method": "ngram" | "draft_model", "num_speculative_tokens": k, ...})',
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="livemoe serve",
                                description="The OpenAI-compatible HTTP server over one AsyncLLM.")
    p.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: the "
                   "checkpoint directory's name); another name gets a 404")
    p.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (loopback only)")
    p.add_argument("--port", type=int, default=8000, help="default: 8000")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when there is one)")
    p.add_argument("--log-level", default="info", help="default: info (one line per finished request)")
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="split chat outputs' <think>...</think> into message.reasoning_content (default: none)")
    p.add_argument("--engine-core", default="process", choices=["process", "thread"],
                   help="where the engine runs: its own process(es) (default) or a thread of the server")
    p.add_argument("--data-parallel-size", type=int, default=1, help="engine cores (replicas) behind this server; "
                   "on GPUs one per device of CUDA_VISIBLE_DEVICES (default: 1)")
    p.add_argument("--on-core-death", default=None, choices=["exit", "restart"],
                   help="when an engine core dies: stop the server with exit code 1, or restart the core while the "
                   "other replicas serve (default: exit with one replica, restart with --data-parallel-size > 1)")
    _add_flags(p.add_argument_group("engine options (EngineConfig)"), EngineConfig)
    _add_flags(p.add_argument_group("server options (ServerConfig)"), ServerConfig)
    return p


def _add_flags(group, config_class) -> None:
    for f in fields(config_class):
        if f.name in SKIPPED_OPTIONS:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        shown = NONE_MEANS.get(f.name, default) if default is None else default
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=f"default: {shown}")
        if isinstance(default, bool):
            group.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        else:
            # the annotation's type (`int | None` -> int)
            kind = f.type if f.type in (int, float, str) else next(t for t in get_args(f.type) if t is not type(None))
            group.add_argument(flag, type=kind, **kw)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from livemoe.engine.async_llm import AsyncLLM
    from livemoe.engine.server import build_app
    from livemoe.engine.server.sockets import header_timeout_protocol

    options = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    options.setdefault("use_tqdm", False)
    server_options = {f.name: getattr(args, f.name) for f in fields(ServerConfig) if hasattr(args, f.name)}
    if os.environ.get(API_KEY_ENV) and "api_key" not in server_options:
        server_options["api_key"] = os.environ[API_KEY_ENV]
    died = threading.Event()
    server = None

    policy = args.on_core_death or ("restart" if args.data_parallel_size > 1 else "exit")

    def on_core_death(index: int, error: BaseException) -> None:  # on the engine client's reader thread
        if policy == "restart" and index >= 0:  # (-1: the client itself failed: no restart)
            logging.getLogger("livemoe.engine.server").error("%s; restarting it", error)
            engine.restart_replica(index)
            return
        logging.getLogger("livemoe.engine.server").error("%s; stopping the server (exit code 1)", error)
        died.set()
        if server is not None:
            server.should_exit = True

    try:
        server_config = ServerConfig(**server_options)  # before the weights load
        if args.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be >= 1, got {args.data_parallel_size}")
        core = {}
        if args.engine_core == "process":
            core = dict(engine_core="process", data_parallel_size=args.data_parallel_size,
                        devices=_devices(args.device, args.data_parallel_size, options.get("tensor_parallel_size", 1)),
                        on_core_death=on_core_death)
        elif args.data_parallel_size != 1 or args.on_core_death is not None:
            raise ValueError("--data-parallel-size and --on-core-death need --engine-core process")
        engine = AsyncLLM(args.model, dtype=args.dtype, device=args.device, **core, **options)
    except ValueError as e:  # EngineConfigError, CheckpointError, RequestError: the message says what
        sys.exit(f"livemoe.engine.server: {e}")
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    try:
        app = build_app(engine, name, server_config, bind_host=args.host, reasoning_parser=args.reasoning_parser)
        server = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level.lower(),
                                               http=header_timeout_protocol(server_config.header_timeout_s)))
        if died.is_set():
            server.should_exit = True
        # uvicorn stops on SIGTERM, then raises it again: as SystemExit here, so the engine cores are
        # stopped (and their sockets removed) below rather than left to notice that we are gone
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
        server.run()
    finally:
        engine.shutdown()
    if died.is_set():
        sys.exit(1)


def _devices(device: str | None, n: int, tp: int = 1) -> list[str] | None:
    """CUDA_VISIBLE_DEVICES for each replica: `tp` devices each (its tensor-parallel ranks), from those visible
    (None on a CPU)."""
    import torch

    if device == "cpu" or (device is None and not torch.cuda.is_available()):
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else \
        [str(i) for i in range(torch.cuda.device_count())]
    if n == 1:
        return None  # the core sees what this process sees
    if len(ids) < n * tp:
        raise ValueError(f"--data-parallel-size {n} x --tensor-parallel-size {tp} needs {n * tp} GPUs; "
                         f"{len(ids)} visible ({ids})")
    return [",".join(ids[i * tp:(i + 1) * tp]) for i in range(n)]


if __name__ == "__main__":
    main()
