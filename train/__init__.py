"""The checkout's `python -m train.rft | train.grpo | train.live | train.experiments` entry points, kept as
documented. rft, grpo and live are one line each that runs `livemoe SUBCOMMAND` (the code is in livemoe/train/);
experiments runs `python -m experiments` (the root experiments/ folder). This folder is not installed: after
`pip install`, use `livemoe SUBCOMMAND` or `python -m livemoe.train.rft` (and the others)."""
