"""Magics for live ranks, loaded with the others by `%load_ext nbtrain`.

    %nbtrain start [--devices 2] [--accelerator cpu] [--backend gloo] [--strategy auto|ddp|fsdp]
                   [--start auto|fork|template|spawn] [--timeout S] [--stall S|off]
                   [--cluster slurm|ray [--partition P --time T --account A --sbatch K=V --address A --num-workers N]]
    %%ranks [--rank 0] [--timeout S] [--no-progress]   the cell runs in every live rank (or those named)
    %nbtrain stop                                       close the live ranks
    %nbtrain warm                                       start the warm template now (nbtrain.warm_up)
    %debug                                              after a WorkerError from live ranks: pdb in that rank

Like the other magics, these only parse and call plain functions (`nbtrain.Ranks`).
"""
from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from IPython.core.error import UsageError
from IPython.core.magic import Magics, cell_magic, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, magic_arguments, parse_argstring

from ...placements.template_process import warm_up
from ..live.lifetime import START_METHODS, WRAPPINGS
from ..live.ranks import Ranks
from ..run import debugger
from .magic_options import ACCELERATORS, CLUSTER_ARGUMENTS, DEFAULTS, make_cluster, parse_seconds, stall_seconds

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell


def _rank_list(text: str) -> list[int]:
    import argparse

    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give a rank or ranks, e.g. 0 or 0,2") from None
    if not ranks or any(r < 0 for r in ranks):
        raise argparse.ArgumentTypeError(f"{text!r}: give a rank or ranks, e.g. 0 or 0,2")
    return ranks


START_ARGUMENTS = [
    argument("--devices", default="auto", help="how many / which devices: 2, -1, '0,1', auto (Lightning's grammar); "
             "with --cluster, ranks per node"),
    argument("--accelerator", default="auto", choices=ACCELERATORS, help="cpu, gpu or auto"),
    argument("--backend", default=None, help="gloo, nccl, ... (default: nccl on GPU, gloo on CPU)"),
    argument("--strategy", default="auto", choices=WRAPPINGS, help="how ctx.setup wraps a model (auto: ddp)"),
    argument("--start", default="auto", choices=START_METHODS, help="where the ranks come from: auto (a fork of the "
             "kernel when safe, else the warm template), fork, template, spawn"),
    argument("--timeout", type=parse_seconds, default=None,
             help="default limit, in seconds, of each cell on the ranks"),
    argument("--stall", type=stall_seconds, default=None, metavar="SECONDS|off", help="seconds without progress "
             "before a cell says where each rank waits (Ranks' stall=; the cell goes on); off: never"),
    *CLUSTER_ARGUMENTS,
]


def _start_options(line):
    """%nbtrain start [options]: start live ranks."""


for _decorator in reversed(START_ARGUMENTS):
    _start_options = _decorator(_start_options)
_start_options = magic_arguments()(_start_options)


@magics_class
class RanksMagics(Magics):
    shell: InteractiveShell  # Magics allows None; a registered magic always has its shell

    def __init__(self, shell, ipython_debug=None):
        super().__init__(shell)
        self._ipython_debug = ipython_debug

    @magic_arguments()
    @argument("--rank", type=_rank_list, default=None, help="run on this rank (or ranks: 0,2) only")
    @argument("--timeout", type=parse_seconds, default=None, help="seconds before the cell is stopped, with stacks")
    @argument("--no-progress", dest="no_progress", action="store_true", help="no dashboard for this cell")
    @cell_magic
    def ranks(self, line: str, cell: str):
        """Run the cell in every live rank's own namespace (state kept); output tagged by rank.

        Names the cell reads that a rank lacks come from the notebook. The last expression's
        value is shown for each rank.
        """
        args = parse_argstring(self.ranks, line)
        try:
            ranks = Ranks.current()
        except LookupError as exc:
            raise UsageError(str(exc)) from None
        if args.rank is not None and any(r >= ranks.world_size for r in args.rank):
            raise UsageError(f"--rank {args.rank}: the live ranks are 0 .. {ranks.world_size - 1}.")
        progress = ranks.progress
        ranks.progress = False if args.no_progress else progress  # for this cell only
        source, filename = debugger.cell_for_ranks(self.shell, cell) or (cell, self._cell_file(cell))
        debugger.sync()  # ranks started since breakpoints were set get them
        try:
            ranks.exec(source, ranks=args.rank, timeout=args.timeout, _namespace=self.shell.user_ns,
                       _filename=filename, _show=True)
        finally:
            ranks.progress = progress

    def _cell_file(self, cell: str) -> str:
        """A file name the kernel knows as this cell, so rank tracebacks read `Cell In[N], line L`."""
        history = getattr(self.shell.history_manager, "input_hist_raw", None)
        number = len(history) - 1 if history else self.shell.execution_count  # stored before the cell runs
        try:
            return self.shell.compile.cache(cell, number)
        except AttributeError:  # a shell without IPython's caching compiler
            return f"<%%ranks In[{number}]>"

    @line_cell_magic
    def debug(self, line: str = "", cell: str | None = None):
        """`%debug`: after a WorkerError from live ranks, pdb in the failed rank; otherwise IPython's."""
        error = getattr(sys, "last_value", None)
        if cell is None and not line.strip() and callable(getattr(error, "debug", None)):
            rank = getattr(error, "rank", None)
            if isinstance(rank, int) and debugger.post_mortem(rank):  # the debugger panel is on: there
                print(f"nbtrain: rank {rank}'s failure is open in the debugger panel; continue closes it.")
                return None
            return error.debug()  # type: ignore[union-attr]  # callable: checked above
        return self._ipython_debug(line, cell)


def command(shell, name: str, rest: str):
    """`%nbtrain start|stop|warm ...`, called by the %nbtrain line magic."""
    if name == "start":
        args = parse_argstring(_start_options, rest)
        cluster = make_cluster({**DEFAULTS, **{k: v for k, v in vars(args).items() if k in DEFAULTS and v is not None}})
        try:
            ranks = Ranks(devices=args.devices, accelerator=args.accelerator, backend=args.backend,
                          timeout=args.timeout, strategy=args.strategy, start=args.start, cluster=cluster,
                          stall=args.stall)
        except (ValueError, TypeError, RuntimeError) as exc:
            raise UsageError(str(exc)) from None
        shell.user_ns["ranks"] = ranks
        print("nbtrain: the live ranks are `ranks` in this notebook; %%ranks cells run on them; "
              "%nbtrain stop ends them.")
        return None
    if name == "stop":
        try:
            Ranks.current().close()
        except LookupError:
            print("nbtrain: no live ranks to stop.")
        return None

    print(f"nbtrain: the warm template is ready ({warm_up():.2f} s)")
    return None


def register(ipython) -> None:
    original = ipython.find_line_magic("debug")
    mine = getattr(original, "__self__", None)
    if isinstance(mine, RanksMagics):  # %load_ext again: keep IPython's own underneath
        original = mine._ipython_debug
    ipython.register_magics(RanksMagics(ipython, original))
    debugger.install(ipython)  # JupyterLab's debugger reaches the ranks
