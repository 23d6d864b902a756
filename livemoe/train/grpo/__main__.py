"""GRPO, stage 2 of the LiveThinking seed (its section 4.2, Table 2): `python -m train.grpo [flags]`.

The command (`livemoe grpo`, `python -m livemoe.train.grpo`, torchrun's `-m livemoe.train.grpo`, the checkout's
`python -m train.grpo`): its flags are GRPOConfig's (livemoe.train.grpo.config), its trainer GRPOTrainer
(livemoe.train.grpo.trainer)."""
import sys

from livemoe.train.config import format_config, parse_config, run_cli
from livemoe.train.grpo.config import GRPOConfig
from livemoe.train.grpo.trainer import GRPOTrainer


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv

    def body():
        cfg = parse_config(GRPOConfig, argv, description=__doc__.split("\n")[0], prog="livemoe grpo")
        if cfg.progress:
            print("GRPO config:\n" + format_config(cfg), flush=True)
        GRPOTrainer(cfg).train()

    return run_cli(body)


if __name__ == "__main__":
    sys.exit(main())
