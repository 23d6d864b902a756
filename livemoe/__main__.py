"""`python -m livemoe SUBCOMMAND [flags]`: the `livemoe` console script without it being on PATH."""
import sys

from livemoe.cli import main

if __name__ == "__main__":
    sys.exit(main())
