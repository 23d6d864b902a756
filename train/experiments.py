"""`python -m train.experiments` from a checkout: `python -m experiments` (the root experiments/, not installed)."""
import sys

if __name__ == "__main__":
    from experiments.__main__ import main

    sys.exit(main(prog="python -m train.experiments"))
