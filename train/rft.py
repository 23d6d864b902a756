"""`python -m train.rft` from a checkout: `livemoe rft` (livemoe/cli.py)."""
from livemoe.cli import checkout_entry_point

checkout_entry_point(__name__, "rft")
