"""python -m train.live: the LiveAssistant seed end to end on the embedded default.

The command (`livemoe live`, `python -m livemoe.train.live`, the checkout's `python -m train.live`): its flags are
LiveConfig's (livemoe.train.live.config), its run livemoe.train.live.trainer.run (or .replay with --replay)."""
import sys

from livemoe.train.config import format_config, parse_config, run_cli
from livemoe.train.live.config import LiveConfig
from livemoe.train.live.trainer import replay, run


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body():
        cfg = parse_config(LiveConfig, argv, description=__doc__.split("\n")[0], prog="livemoe live")
        if cfg.replay:
            replay(cfg)
            return
        if cfg.progress:
            print("live config:\n" + format_config(cfg), flush=True)
        run(cfg)

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
