"""The options `%%nbtrain` and `%nbtrain start` share: their argparse definitions, session
defaults, and the cluster object a cell's `--cluster` options describe."""
from __future__ import annotations

import argparse

from IPython.core.error import UsageError
from IPython.core.magic_arguments import argument

from ...placements.clusters import Ray, Slurm
from ...placements.script import parse_endpoint
from ..run.choices import ALIASES, STARTS, STRATEGIES
from ..run.doctor import DEFAULT_STALL, STALL_STEPS

ACCELERATORS = ("auto", "cpu", "gpu", "cuda")
LAUNCHERS = ("torchrun", "accelerate", "deepspeed")
RESULT_NAME = "_nbtrain_result"
RUN_NAME = "_nbtrain_run"  # the Run of the last `%%nbtrain --submit` cell
CLUSTERS = ("slurm", "ray")
TRACKERS = ("tensorboard", "mlflow", "wandb")
DEFAULTS = {"strategy": "auto", "start": "auto", "devices": "auto", "accelerator": "auto", "nnodes": 1, "node_rank": 0,
            "rdzv_endpoint": None, "max_restarts": 0, "launcher": "torchrun", "timeout": None, "stall": None,
            "no_progress": False,
            "cluster": None, "partition": None, "time": None, "account": None, "sbatch": None, "address": None,
            "num_workers": None, "notebook_address": None, "trackers": None, "profile": None, "run_dir": None,
            "submit": False}
CLUSTER_OPTIONS = {"slurm": ("partition", "time", "account", "sbatch"), "ray": ("address", "num_workers")}
LOCAL_ONLY = ("node_rank", "rdzv_endpoint", "max_restarts", "launcher")  # ranks this machine starts itself
COMMANDS = "Accepted: `%nbtrain config [options]`, `%nbtrain config reset`, `%nbtrain gpus`, " \
           "`%nbtrain start [options]` / `%nbtrain stop` (live ranks, then `%%ranks` cells), `%nbtrain warm`, " \
           "`%nbtrain attach PATH` / `%nbtrain runs [PATH]` (submitted runs), `%nbtrain export PATH`; " \
           "`%%nbtrain [options]` as a cell's first line runs the cell on every rank."


def _at_least(low: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"{value} is too small: give an integer >= {low}")
        return value

    parse.__name__ = f"integer >= {low}"
    return parse


def parse_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r}: give a positive number of seconds")
    return value


def stall_seconds(text: str) -> float | bool:
    """`--stall SECONDS` or `--stall off`: launch's `stall=` as a number, or False."""
    if text.strip().lower() == "off":
        return False
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give a positive number of seconds without progress before the doctor says where each rank "
            f"is, or off to never check (default: max({DEFAULT_STALL:g} s, {STALL_STEPS}x the recent step time))")
    return value


def shown_setting(key: str, value) -> str | None:
    """A setting as `%nbtrain config` shows it ('--stall off', '--profile'), None for one left out."""
    flag = f"--{key.replace('_', '-')}"
    if value is None or (value is False and key != "stall"):  # a flag that is off, or no value
        return None
    if value is True:
        return flag
    if value is False:
        return f"{flag} off"
    return f"{flag} {' '.join(value) if isinstance(value, list) else value}"


def _endpoint(text: str) -> str:
    try:
        parse_endpoint(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


# Defaults are None here: what a cell leaves out comes from `%nbtrain config`, then DEFAULTS.
RUN_OPTIONS = [
    argument("--strategy", choices=(*STRATEGIES, *ALIASES), metavar="{" + ",".join(STRATEGIES) + "}",
             help="how ctx.setup wraps a model (as launch's strategy=; the earlier names ddp_fork, ddp_spawn... work)"),
    argument("--start", choices=STARTS,
             help="where the ranks come from: auto (a fork of the kernel when safe, else the warm template; "
             "torchrun with --nnodes, --launcher...), fork, template, spawn, torchrun (the cell as a script)"),
    argument("--devices", help="how many / which devices: 2, -1, '0,1', auto (Lightning's grammar)"),
    argument("--accelerator", choices=ACCELERATORS, help="cpu, gpu or auto"),
    argument("--nnodes", type=_at_least(1), help="machines taking part (under torchrun, or with --cluster)"),
    argument("--node-rank", dest="node_rank", type=_at_least(0), help="this machine's place, 0 .. nnodes-1"),
    argument("--rdzv-endpoint", dest="rdzv_endpoint", type=_endpoint, help="HOST:PORT of node 0, the same everywhere"),
    argument("--max-restarts", dest="max_restarts", type=_at_least(0), help="times all ranks may start again after a "
             "failure (torchrun's own restarts under --start torchrun)"),
    argument("--launcher", choices=LAUNCHERS, help="what runs the script under --start torchrun: torchrun (default), "
             "accelerate; deepspeed (the launcher of --strategy deepspeed)"),
    argument("--timeout", type=parse_seconds, help="seconds before the run is stopped, with every rank's stack"),
    argument("--stall", type=stall_seconds, metavar="SECONDS|off", help="seconds without progress on any rank "
             "before the cell says where each rank waits (launch's stall=; the run goes on); off: never"),
    argument("--no-progress", dest="no_progress", action="store_true", default=None, help="no progress display"),
    argument("--trackers", nargs="+", choices=TRACKERS, metavar="TRACKER",
             help=f"where ctx.log's values go besides the notebook: {', '.join(TRACKERS)}"),
    argument("--profile", action="store_true", default=None, help="torch.profiler on every rank: the Result's profile"),
    argument("--run-dir", dest="run_dir", help="the directory trackers and profiles write under"),
    argument("--submit", action="store_true", default=None, help="a run that outlives the kernel (nbtrain.submit): "
             "the cell shows its Run, kept as _nbtrain_run; --max-restarts restarts all its ranks"),
]
CLUSTER_ARGUMENTS = [  # also taken by `%nbtrain start` (live ranks on a cluster)
    argument("--cluster", choices=CLUSTERS, help="run the ranks on a SLURM cluster (submitit) or a Ray cluster"),
    argument("--partition", help="slurm: the partition"),
    argument("--time", help="slurm: the job's time limit (minutes, or HH:MM:SS)"),
    argument("--account", help="slurm: the account charged"),
    argument("--sbatch", nargs="+", action="extend", metavar="KEY=VALUE", help="slurm: more sbatch options (qos=high)"),
    argument("--address", help="ray: the cluster's address (default: this kernel's Ray, or a new local one)"),
    argument("--num-workers", dest="num_workers", type=_at_least(1), help="ray: ranks, placed wherever they fit"),
    argument("--notebook-address", dest="notebook_address", help="cluster: the address the nodes reach this kernel by"),
]
RUN_OPTIONS += CLUSTER_ARGUMENTS


def run_options(func):
    """Stack the run options on a magic; they show in its help in the order listed."""
    for decorator in reversed(RUN_OPTIONS):
        func = decorator(func)
    return func


def given_options(args) -> dict:
    return {k: v for k, v in vars(args).items() if k in DEFAULTS and v is not None}


def make_cluster(options: dict):
    """The cluster object a cell's --cluster options describe (None: this machine)."""
    name = options["cluster"]
    given = [k for k in ("partition", "time", "account", "sbatch", "address", "num_workers", "notebook_address")
             if options[k] is not None and k not in CLUSTER_OPTIONS.get(name, ()) + ("notebook_address",)]
    if given or (name is None and options["notebook_address"] is not None):
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in given or ["notebook_address"])
        where = f"--cluster {name}" if name else "no --cluster"
        raise UsageError(f"{flags} do not apply with {where}. Options per cluster: " + "; ".join(
            f"--cluster {c}: " + ", ".join(f"--{k.replace('_', '-')}" for k in ks)
            for c, ks in CLUSTER_OPTIONS.items()))
    if name is None:
        return None
    changed = [k for k in LOCAL_ONLY if options[k] != DEFAULTS[k]]
    if changed or options["strategy"] not in ("auto", "ddp", "fsdp") or options["start"] != "auto":
        flags = ", ".join(f"--{k.replace('_', '-')}" for k in changed) or (
            f"--start {options['start']}" if options["start"] != "auto" else f"--strategy {options['strategy']}")
        raise UsageError(f"{flags} apply to ranks started on this machine; with --cluster {name} the cluster starts "
                         "them, wrapped by --strategy auto, ddp or fsdp (--devices is ranks per node, --nnodes the "
                         "nodes).")
    try:
        if name == "slurm":
            time_limit = options["time"]
            extra = dict(_key_value(item) for item in options["sbatch"] or ())
            return Slurm(partition=options["partition"], account=options["account"],
                         time=int(time_limit) if time_limit and time_limit.isdigit() else time_limit,
                         notebook_address=options["notebook_address"], **extra)  # type: ignore[arg-type]  # Slurm checks
        return Ray(address=options["address"], num_workers=options["num_workers"],
                   notebook_address=options["notebook_address"])
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _key_value(item: str) -> tuple[str, str | bool]:
    key, sep, value = item.partition("=")
    if not key.strip():
        raise UsageError(f"--sbatch {item!r}: give KEY=VALUE (e.g. qos=high, mem=16G) or a flag's KEY (exclusive).")
    return key.strip(), value if sep else True
