"""`python -m train.grpo` from a checkout: `livemoe grpo` (livemoe/cli.py)."""
from livemoe.cli import checkout_entry_point

checkout_entry_point(__name__, "grpo")
