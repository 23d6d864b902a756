"""`python -m engine.serve --model PATH [--host 127.0.0.1] [--port 8000] [engine options] [server options]`:
the OpenAI-compatible server (engine/server/) over one AsyncLLM, run by uvicorn.

Engine options are EngineConfig's fields as flags (`--max-num-seqs 64`, `--threads 1`,
`--no-enable-prefix-caching`), server options ServerConfig's (`--max-n 16`, `--max-body-bytes 1048576`,
`--api-key KEY`, `--allowed-hosts a.example,b.example`, `--enable-docs`); those not given keep the
dataclasses' defaults. The API key may also come from the LIVEMOE_API_KEY environment variable (a flag
shows in `ps`; the variable does not). `--dtype` and `--device` choose how the weights load.
"""
import argparse
import logging
import os
import sys
from dataclasses import MISSING, fields
from typing import get_args

from engine.engine_config import EngineConfig
from engine.server.config import ServerConfig

SKIPPED_OPTIONS = {"use_tqdm"}  # meaningless for a server
API_KEY_ENV = "LIVEMOE_API_KEY"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.serve",
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
    _add_flags(p.add_argument_group("engine options (EngineConfig)"), EngineConfig)
    _add_flags(p.add_argument_group("server options (ServerConfig)"), ServerConfig)
    return p


def _add_flags(group, config_class) -> None:
    for f in fields(config_class):
        if f.name in SKIPPED_OPTIONS:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=f"default: {default}")
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

    from engine.async_llm import AsyncLLM
    from engine.server import build_app

    options = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    options.setdefault("use_tqdm", False)
    server_options = {f.name: getattr(args, f.name) for f in fields(ServerConfig) if hasattr(args, f.name)}
    if os.environ.get(API_KEY_ENV) and "api_key" not in server_options:
        server_options["api_key"] = os.environ[API_KEY_ENV]
    try:
        server_config = ServerConfig(**server_options)  # before the weights load
        engine = AsyncLLM(args.model, dtype=args.dtype, device=args.device, **options)
    except ValueError as e:  # EngineConfigError, CheckpointError, RequestError: the message says what
        sys.exit(f"engine.serve: {e}")
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    try:
        uvicorn.run(build_app(engine, name, server_config, bind_host=args.host, reasoning_parser=args.reasoning_parser),
                    host=args.host, port=args.port, log_level=args.log_level.lower())
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
