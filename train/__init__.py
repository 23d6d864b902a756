"""The checkout's `python -m train.rft | train.grpo | train.live | train.experiments` entry points, kept as
documented. Each is one line that runs `livemoe SUBCOMMAND`; the code is in livemoe/train/. This folder is not
installed: after `pip install`, use `livemoe SUBCOMMAND` or `python -m livemoe.train.rft` (and the others)."""
