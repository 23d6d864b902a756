"""`python -m engine.serve --model PATH [--host 127.0.0.1] [--port 8000] [engine options]`: the
OpenAI-compatible server (engine/server/) over one AsyncLLM, run by uvicorn.

Engine options are EngineConfig's fields as flags (`--max-num-seqs 64`, `--no-enable-prefix-caching`);
those not given keep EngineConfig's defaults. `--dtype` and `--device` choose how the weights load.
"""
import argparse
import logging
import os
import sys
from dataclasses import MISSING, fields

from engine.engine_config import EngineConfig

SKIPPED_OPTIONS = {"use_tqdm"}  # meaningless for a server


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m engine.serve",
                                description="The OpenAI-compatible HTTP server over one AsyncLLM.")
    p.add_argument("--model", required=True, help="checkpoint directory (config.json, *.safetensors, tokenizer)")
    p.add_argument("--served-model-name", default=None, help="the name clients send as `model` (default: the "
                   "checkpoint directory's name)")
    p.add_argument("--host", default="127.0.0.1", help="default: 127.0.0.1 (loopback only)")
    p.add_argument("--port", type=int, default=8000, help="default: 8000")
    p.add_argument("--dtype", default=None, help="float32 | bfloat16 | float16 (default: the checkpoint's)")
    p.add_argument("--device", default=None, help="cuda | cpu (default: cuda when there is one)")
    p.add_argument("--log-level", default="info", help="default: info (one line per finished request)")
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3", "deepseek_r1"],
                   help="split chat outputs' <think>...</think> into message.reasoning_content (default: none)")
    engine = p.add_argument_group("engine options (EngineConfig)")
    for f in fields(EngineConfig):
        if f.name in SKIPPED_OPTIONS:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = f.default if f.default is not MISSING else None
        kw = dict(dest=f.name, default=argparse.SUPPRESS, help=f"default: {default}")
        if isinstance(default, bool):
            engine.add_argument(flag, action=argparse.BooleanOptionalAction, **kw)
        else:
            kind = {int: int, float: float, str: str}.get(type(default), int)  # None defaults are ints
            engine.add_argument(flag, type=kind, **kw)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    import uvicorn

    from engine.async_llm import AsyncLLM
    from engine.server import build_app

    options = {f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)}
    options.setdefault("use_tqdm", False)
    try:
        engine = AsyncLLM(args.model, dtype=args.dtype, device=args.device, **options)
    except ValueError as e:  # EngineConfigError, CheckpointError, RequestError: the message says what
        sys.exit(f"engine.serve: {e}")
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    try:
        uvicorn.run(build_app(engine, name, args.reasoning_parser), host=args.host, port=args.port, log_level=args.log_level.lower())
    finally:
        engine.shutdown()


if __name__ == "__main__":
    main()
