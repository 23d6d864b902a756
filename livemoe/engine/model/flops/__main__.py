"""`livemoe flops`: parameters, decode FLOPs per token and (with --prompt) prefill FLOPs, as JSON.

The CLI lives here, not in livemoe/engine/model/flops/__init__.py: `import livemoe.engine` already imports livemoe.engine.model.flops (the
decoder counts FLOPs), and runpy warns when the module it is asked to run as __main__ is imported first.
"""
import argparse
import json
import sys

from livemoe.engine.errors import CheckpointError
from livemoe.engine.model.flops import preset_names, report, resolve_config


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="livemoe flops", description="Parameters (total, active), decode FLOPs per token and, with "
                                "--prompt N, prefill FLOPs of a checkpoint or preset, as JSON.")
    p.add_argument("model", help=f"checkpoint dir, config.json, or a preset: {', '.join(preset_names())}")
    p.add_argument("--context", type=int, default=0, help="context length for the attention term of decode")
    p.add_argument("--prompt", type=int, default=0, help="prompt length: adds prefill FLOPs to the report")
    p.add_argument("--tokens", type=int, default=0, help="tokens per response for decode TFLOPs per response")
    args = p.parse_args(argv)
    for name in ("context", "prompt", "tokens"):
        if getattr(args, name) < 0:
            p.error(f"--{name} must be >= 0")
    try:
        cfg = resolve_config(args.model)
    except CheckpointError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps(report(cfg, args.context, args.prompt, args.tokens), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
