"""`nbtrain demo` and `nbtrain gpus`."""
from __future__ import annotations

import argparse
import sys

from . import __version__

# The commands' modules are imported when a command runs: `nbtrain --version` and `--help` need
# no torch (seconds to import).


def _gpus(args) -> int:
    from .display.gpus import gpus

    print(gpus())
    return 0


def _demo(args) -> int:
    from .demo import METRIC, train
    from .notebook.launch import launch

    result = launch(train, args.epochs, devices=args.devices, accelerator=args.accelerator,
                    strategy=args.strategy, start=args.start, timeout=args.timeout)
    # Two kinds of loss, labelled apart: each rank's own last batch, and the logged mean over ranks.
    for value in result.values:
        print(f"rank {value['rank']}: last batch loss {value['last_batch_loss']:.4f} (this rank's own batch)")
    print(f"mean over ranks: {result.metrics(METRIC)[-1]:.4f} (the {METRIC}= in the table above, "
          "synced by ctx.log(..., sync_dist=True))")
    print(f"effective batch size: {result.effective_batch_size}  ({result.devices}, {result.strategy}, "
          f"{result.start}, {result.elapsed:.2f} s)")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nbtrain", description="Multi-device PyTorch training from notebooks.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="command")
    commands.add_parser("gpus", help="list visible GPUs with memory, utilisation and processes").set_defaults(run=_gpus)
    demo = commands.add_parser("demo", help="train a small synthetic model across ranks (CPU when no GPU)")
    demo.add_argument("--devices", default="2", help="Lightning's devices grammar: 2, -1, '0,1', 'free:2' (default: 2)")
    demo.add_argument("--accelerator", default="auto", choices=["auto", "cpu", "gpu", "cuda"])
    demo.add_argument("--strategy", default="auto", help="how models are wrapped: auto, ddp, fsdp, dp (default: auto)")
    demo.add_argument("--start", default="auto", help="where the ranks come from: auto, fork, template, spawn, "
                      "torchrun (default: auto)")
    demo.add_argument("--epochs", type=int, default=3)
    demo.add_argument("--timeout", type=float, default=600.0, help="seconds before the run is stopped (default: 600)")
    demo.set_defaults(run=_demo)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `nbtrain`: say what it can do
        parser.print_help()
        return 0
    try:
        return args.run(args)
    except (ValueError, TypeError, RuntimeError) as exc:  # bad devices/strategy, no GPU, a failed rank
        parser.exit(2, f"nbtrain {args.command}: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
