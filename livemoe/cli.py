"""`livemoe SUBCOMMAND [flags]` (and `python -m livemoe SUBCOMMAND`), as `vllm serve` and `trl grpo` are: each
subcommand is one module's own `main(argv)`, so the flags and `--help` are that module's, and
`python -m livemoe.train.rft ...` does exactly what `livemoe rft ...` does."""
import importlib
import sys

# subcommand -> (module whose main(argv) runs it, one line for `livemoe --help`)
COMMANDS = {
    "serve": ("livemoe.engine.server.__main__", "OpenAI-compatible HTTP server over the streaming decoder"),
    "rft": ("livemoe.train.rft.__main__", "rejection-sampling fine-tuning (LiveThinking stage 1)"),
    "grpo": ("livemoe.train.grpo.__main__", "GRPO with the correctness / helpfulness / length reward (stage 2)"),
    "live": ("livemoe.train.live.__main__", "LiveAssistant: MA-MSFT then SM-GSPO on live sessions"),
    "flops": ("livemoe.engine.model.flops.__main__", "parameters and decode / prefill FLOPs of a checkpoint or preset"),
    "export-gguf": ("livemoe.engine.model.gguf_export", "a checkpoint as a GGUF file for llama.cpp / Ollama"),
    "plan": ("livemoe.train.plan", "what one GPU holds when a model trains with FSDP2 + expert parallel"),
}


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {about}" for name, (_, about) in COMMANDS.items()]
    return ("usage: livemoe SUBCOMMAND [flags]   (livemoe SUBCOMMAND --help for its flags)\n\nsubcommands:\n"
            + "\n".join(lines))


def run(name: str, argv: list[str]) -> int:
    """Runs subcommand `name` with its flags; what its main returns (None counts as success)."""
    module = importlib.import_module(COMMANDS[name][0])
    sys.argv = [f"livemoe {name}", *argv]  # for code that reads sys.argv (the live run records its command)
    return module.main(argv) or 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] not in COMMANDS:
        print(f"livemoe: unknown subcommand {argv[0]!r}\n\n{usage()}", file=sys.stderr)
        return 2
    return run(argv[0], argv[1:])


def checkout_entry_point(module_name: str, name: str) -> None:
    """The body of the checkout's `train/NAME.py`: run as `python -m train.NAME`, it is `livemoe NAME`;
    imported, it does nothing."""
    if module_name == "__main__":
        sys.exit(main([name, *sys.argv[1:]]))
