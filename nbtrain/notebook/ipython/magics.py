"""IPython magics, loaded by `%load_ext nbtrain`.

    %%nbtrain [options]        run the cell on every rank, as launch runs a function (--strategy and
                               --start as launch's strategy= and start=: by default a fork of the
                               kernel when safe, else the warm template; --start torchrun: the cell
                               as a script; --cluster slurm|ray: on a cluster's nodes)
    %nbtrain config [options]  session defaults for those options; alone, shows them; `config reset` clears
    %nbtrain gpus              the GPU table (`nbtrain.gpus()`)
    %%nbtrain --submit [options]   the cell as a run that outlives the kernel (`nbtrain.submit`)
    %nbtrain attach PATH       a submitted run again (`nbtrain.attach`); `%nbtrain runs [PATH]` lists them
    %nbtrain export PATH       the last %%nbtrain cell as a job directory (`nbtrain.export`): run.sh, sbatch.sh

The cell's `Result` is stored in the user namespace as `_nbtrain_result` (rank 0's last
expression value in `.value`). The magics only parse options and call
`nbtrain.notebook.ipython.cell.run_cell`, which works without IPython too.
"""
from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import magic_arguments, parse_argstring
from IPython.display import display

from ...common.devices import plan_devices
from ...display.gpus import gpus
from ...placements.script import check_installed, script_options
from ...rank.trackers import check_trackers
from ..detached.export import export
from ..detached.listing import runs
from ..detached.runs import attach
from ..detached.submit import submit
from ..run.choices import choose, deepspeed_options
from ..run.launch import check_cluster_words
from ..run.options import RunOptions
from .cell import cell_job, run_cell
from .magic_options import (
    COMMANDS,
    DEFAULTS,
    RESULT_NAME,
    RUN_NAME,
    given_options,
    make_cluster,
    run_options,
    shown_setting,
)
from .ranks_magics import command as live_command
from .ranks_magics import register as register_live

if TYPE_CHECKING:
    from IPython.core.interactiveshell import InteractiveShell


def check_options(options: dict) -> None:
    """Refuse, as UsageError, what cannot run, before anything starts."""
    try:
        check_trackers(options["trackers"])
        asked = RunOptions(options["strategy"], options["start"], options["devices"], options["accelerator"],
                           options["nnodes"], None, options["timeout"], options["stall"], script_settings(options),
                           options["max_restarts"]).asked
    except (ValueError, ImportError) as exc:
        raise UsageError(str(exc)) from None
    cluster = make_cluster(options)
    if cluster is not None:
        try:
            check_cluster_words(asked, cluster)
            cluster.plan(options["devices"], options["accelerator"], None, options["nnodes"])
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        return

    nodes, launcher = options["nnodes"], _launcher(options)
    if launcher == "deepspeed" and asked.strategy != "deepspeed":
        raise UsageError(f"--launcher deepspeed runs --strategy deepspeed (the cell calls deepspeed.initialize); "
                         f"--strategy {options['strategy']} runs under torchrun or accelerate.")
    if asked.strategy == "fsdp" and launcher != "torchrun":
        raise UsageError(f"--strategy fsdp runs under torchrun; --launcher {launcher} is for --strategy ddp.")
    given = script_settings(options)
    if given and (asked.strategy == "dp" or asked.start not in ("auto", "torchrun")):
        flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in given.items())
        raise UsageError(f"{flags} starts a script under torchrun: it needs --start torchrun (or auto) and --strategy "
                         f"auto, ddp or fsdp (got --strategy {options['strategy']} --start {options['start']}).")
    try:
        plan = plan_devices(options["devices"], options["accelerator"], None, nodes)
        if choose(asked, plan).start == "torchrun":
            settings = {k: options[k] for k in ("node_rank", "rdzv_endpoint", "max_restarts")}
            if asked.strategy == "deepspeed":
                settings = deepspeed_options({**settings, "launcher": launcher})
            script_options({**settings, "launcher": launcher}, nodes)
            check_installed(launcher)
    except (ValueError, TypeError, RuntimeError, ImportError) as exc:
        raise UsageError(str(exc)) from None


def script_settings(options: dict) -> dict | None:
    """torchrun's settings the cell's options give (None: none): with them, --start auto is torchrun."""
    given = {k: options[k] for k in ("launcher", "node_rank", "rdzv_endpoint")
             if options[k] != DEFAULTS[k] and not (k == "launcher" and options[k] == "deepspeed")}
    return given or None


def _launcher(options: dict) -> str:
    # --strategy deepspeed means DeepSpeed's launcher; torchrun is only the session default.
    if options["strategy"] == "deepspeed" and options["launcher"] == "torchrun":
        return "deepspeed"
    return options["launcher"]


def rerun_line(options: dict) -> str:
    """The magic line another node runs: this one with its own `--node-rank`."""
    parts = ["%%nbtrain", "--strategy", options["strategy"], "--start", "torchrun", "--devices",
             str(options["devices"]),
             "--accelerator", options["accelerator"], "--nnodes", str(options["nnodes"]), "--node-rank", "{node_rank}",
             "--rdzv-endpoint", options["rdzv_endpoint"]]
    if options["launcher"] != "torchrun":
        parts += ["--launcher", options["launcher"]]
    if options["max_restarts"]:
        parts += ["--max-restarts", str(options["max_restarts"])]
    return " ".join(shlex.quote(p) if p != "{node_rank}" else p for p in parts)


@magics_class
class NbtrainMagics(Magics):
    shell: InteractiveShell  # Magics allows None; a registered magic always has its shell

    def __init__(self, shell):
        super().__init__(shell)
        self.config_options: dict = {}  # `%nbtrain config`: this session's defaults
        self.last_cell: tuple[str, dict] | None = None

    @magic_arguments()
    @run_options
    @line_cell_magic
    def nbtrain(self, line: str, cell: str | None = None):
        """Run a cell on every rank (`%%nbtrain [options]`), or `%nbtrain config|gpus`.

        The cell's Result is stored as `_nbtrain_result`.
        """
        if cell is None:
            return self._command(line)
        given = given_options(parse_argstring(self.nbtrain, line))
        options = {**DEFAULTS, **self.config_options, **given}
        check_options(options)
        if options["submit"] and "stall" in given:  # said by the live view of a kernel; a session default is not
            raise UsageError("--stall applies to a run this kernel watches; a --submit run keeps the default "
                             "(leave --stall out, or run without --submit).")
        self.last_cell = (cell, options)  # for `%nbtrain export PATH`
        if options["submit"]:
            self.shell.user_ns[RUN_NAME] = run = self.submit(cell, options)
            return run  # the cell's output: the run's live view
        self.shell.user_ns[RESULT_NAME] = None  # a failed run leaves no earlier result behind
        self.shell.user_ns[RESULT_NAME] = self.run(cell, options)

    def run(self, cell: str, options: dict):
        return run_cell(
            cell, self.shell.user_ns, strategy=options["strategy"], start=options["start"], devices=options["devices"],
            accelerator=options["accelerator"], num_nodes=options["nnodes"], node_rank=options["node_rank"],
            rdzv_endpoint=options["rdzv_endpoint"], max_restarts=options["max_restarts"],
            launcher=_launcher(options), timeout=options["timeout"], stall=options["stall"],
            progress=not options["no_progress"],
            hidden=self.shell.user_ns_hidden, cluster=make_cluster(options), trackers=options["trackers"],
            profile=bool(options["profile"]), run_dir=options["run_dir"],
            rerun_as=rerun_line(options) if options["nnodes"] > 1 and not options["cluster"] else None)

    def submit(self, cell: str, options: dict):
        if options["cluster"]:
            raise UsageError("--submit runs on this machine for now; --cluster runs live with the kernel.")
        job = cell_job(cell, self.shell.user_ns, hidden=self.shell.user_ns_hidden)
        script = script_settings(options)
        # --max-restarts restarts the submitted run's ranks (all of them, from ctx.run_dir's checkpoint).
        return submit(job, strategy=options["strategy"], start=options["start"], devices=options["devices"],
                      accelerator=options["accelerator"],
                      num_nodes=options["nnodes"], timeout=options["timeout"], launcher_options=script,
                      max_restarts=options["max_restarts"], trackers=options["trackers"],
                      profile=bool(options["profile"]), run_dir=options["run_dir"])

    def _command(self, line: str):
        words = line.split(None, 1)
        command, rest = (words[0], words[1] if len(words) > 1 else "") if words else ("", "")
        if command == "config":
            return self._config(rest)
        if command == "gpus":
            display(gpus())
            return None
        if command == "attach":
            if not rest.strip():
                raise UsageError("%nbtrain attach PATH: give a run directory (`%nbtrain runs` lists them).")
            return attach(rest.strip())
        if command == "export":
            return self._export(rest.strip())
        if command == "runs":
            return runs(rest.strip() or "nbtrain-runs")
        if command in ("start", "stop", "warm"):
            return live_command(self.shell, command, rest)
        what = f"unknown command {command!r}" if command else "a command is needed"
        raise UsageError(f"%nbtrain: {what}. {COMMANDS}")

    def _export(self, path: str):
        if not path:
            raise UsageError("%nbtrain export PATH: give a new directory for the job.")
        if self.last_cell is None:
            raise UsageError("%nbtrain export PATH exports the last %%nbtrain cell; run one first.")
        cell, options = self.last_cell
        job = cell_job(cell, self.shell.user_ns, hidden=self.shell.user_ns_hidden)  # the names as they are now
        where = export(job, to=path, devices=options["devices"], accelerator=options["accelerator"],
                       num_nodes=options["nnodes"])
        print(f"nbtrain: the last %%nbtrain cell is a job in {path}: bash run.sh, or sbatch sbatch.sh")
        return where

    def _config(self, rest: str) -> None:
        if rest.strip() == "reset":
            self.config_options.clear()
        else:
            given = given_options(parse_argstring(self.nbtrain, rest))
            check_options({**DEFAULTS, **self.config_options, **given})
            self.config_options.update(given)
        settings = {**DEFAULTS, **self.config_options}
        shown = " ".join(word for word in (shown_setting(k, v) for k, v in settings.items()) if word)
        mine = ", ".join(f"--{k.replace('_', '-')}" for k in DEFAULTS if k in self.config_options) or "none"
        print(f"nbtrain: %%nbtrain defaults: {shown} (set by %nbtrain config: {mine})")


def register(ipython) -> None:
    ipython.register_magics(NbtrainMagics)
    register_live(ipython)
