"""`python -m nbtrain ...`: the `nbtrain` command, where its script is not on PATH (a notebook's `!`)."""
import sys

from .cli import main

if __name__ == "__main__":  # a tool that imports every module (docs, linters) runs nothing
    sys.exit(main())
