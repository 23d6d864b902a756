"""`python -m train.rft`: rejection-sampling fine-tuning, stage 1 of the LiveThinking seed (its section 4.1).

The command (`livemoe rft`, `python -m livemoe.train.rft`, the checkout's `python -m train.rft`): its flags are
RFTConfig's (livemoe.train.rft.config), its run is livemoe.train.rft.trainer.run."""
import sys

from livemoe.train.config import parse_config, run_cli
from livemoe.train.rft.config import RFTConfig
from livemoe.train.rft.trainer import run


def main(argv=None) -> int:
    return run_cli(lambda: run(parse_config(RFTConfig, argv, description=__doc__.split("\n")[0], prog="livemoe rft")))


if __name__ == "__main__":
    sys.exit(main())
