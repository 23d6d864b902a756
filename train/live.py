"""`python -m train.live` from a checkout: `livemoe live` (livemoe/cli.py)."""
from livemoe.cli import checkout_entry_point

checkout_entry_point(__name__, "live")
