"""`nbtrain demo` and `nbtrain gpus`."""
from __future__ import annotations

import argparse
import sys


def _gpus(args) -> int:
    from .inventory import gpus

    print(gpus())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nbtrain", description="Multi-device PyTorch training from notebooks.")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("gpus", help="list visible GPUs with memory, utilisation and processes").set_defaults(run=_gpus)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
