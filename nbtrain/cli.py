"""`nbtrain demo`, `nbtrain gpus`, and `nbtrain runs` / `attach` / `cancel` for submitted runs."""
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
    from .notebook.run.launch import launch

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


def _runs(args) -> int:
    import os

    from .notebook.detached.listing import runs

    if not os.path.lexists(args.path):
        raise ValueError(f"{args.path!r} does not exist: give the folder that holds run directories (by default "
                         "nbtrain-runs, where nbtrain.submit puts them)")
    table = runs(args.path)
    print(repr(table) if table else f"no runs under {args.path}")
    return 0


def _cancel(args) -> int:
    """Stop a submitted run (as ``Run.cancel()``) and say how it ended."""
    from .notebook.detached.runs import Run

    run = Run(args.path, progress=False)
    before = run.status
    run.cancel()
    after = run.status
    if before in ("finished", "failed", "cancelled"):
        print(f"{run.function}: already {before}; nothing to cancel")
    else:
        print(f"{run.function}: {after}" + (f" ({run.reason})" if run.reason else ""))
    return 0


def _attach(args) -> int:
    """A submitted run as text, for a shell: where it stands, its last lines, what it gave back.
    It does not wait: `nbtrain attach` again (or `watch -n 5`) to follow it."""
    from .common.errors import WorkerError
    from .notebook.detached.runs import Run

    run = Run(args.path, progress=False)
    print(f"{run.function}: {run.status}" + (f" ({run.reason})" if run.reason else ""))
    for why in run.restarts:
        print(f"restarted: {why}")
    lines = run.logs(args.rank, last=args.lines).splitlines()[-args.lines:] if args.lines else []
    if lines:
        print(f"--- rank {args.rank}, last {len(lines)} line{'s' if len(lines) > 1 else ''} ---")
        print("\n".join(lines))
    if run.status == "finished":
        print(f"--- result ---\n{run.result(timeout=1)!r}")
    elif run.status == "failed":
        try:
            run.result(timeout=1)
        except WorkerError as error:  # a rank's error, with its rank and traceback
            print(f"--- error ---\n{error}")
        except Exception as error:  # noqa: BLE001 - a one-device run's own exception, as launch raises it
            print(f"--- error ---\n{type(error).__name__}: {error}")
    return 1 if run.status in ("failed", "cancelled") else 0


def _lines(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"{text}: give a number of lines, 0 or more")
    return int(text)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nbtrain", description="Multi-device PyTorch training from notebooks.")
    parser.add_argument("-V", "--version", action="version", version=f"%(prog)s {__version__}")
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
    listing = commands.add_parser("runs", help="the submitted runs under a folder: function, started, devices, "
                                  "status, last metrics")
    listing.add_argument("path", nargs="?", default="nbtrain-runs", help="the folder (default: nbtrain-runs)")
    listing.set_defaults(run=_runs)
    attach = commands.add_parser("attach", help="a submitted run: its status, last log lines, and result when "
                                 "finished (exit status 1 if it failed or was cancelled)")
    attach.add_argument("path", help="the run's directory (`nbtrain runs` lists them)")
    attach.add_argument("--lines", type=_lines, default=10, help="how many of the last log lines (default: 10)")
    attach.add_argument("--rank", type=int, default=0, help="whose log lines (default: 0)")
    attach.set_defaults(run=_attach)
    cancel = commands.add_parser("cancel", help="stop a submitted run: its ranks stop as on Ctrl-C, nothing of its "
                                 "processes is left (a SLURM run's jobs are cancelled)")
    cancel.add_argument("path", help="the run's directory (`nbtrain runs` lists them)")
    cancel.set_defaults(run=_cancel)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # a bare `nbtrain`: say what it can do
        parser.print_help()
        return 0
    try:
        return args.run(args)
    # Bad devices/strategy, no GPU, a failed rank, not a run directory, another user's run.
    except (ValueError, TypeError, RuntimeError, PermissionError) as exc:
        parser.exit(2, f"nbtrain {args.command}: {exc}\n")


if __name__ == "__main__":
    sys.exit(main())
