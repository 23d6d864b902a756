"""`python -m train.experiments` from a checkout: `livemoe experiments` (livemoe/cli.py)."""
from livemoe.cli import checkout_entry_point

checkout_entry_point(__name__, "experiments")
