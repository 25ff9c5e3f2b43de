"""Experiment trackers fed by `ctx.log`, as the notebook names them: TensorBoard, MLflow and Weights & Biases.

The settings objects (`TensorBoard`, `MLflow`, `WandB`) are plain data made in the notebook; each
rank opens its writer from them (`tracker_writers.py`), driven by its `Trackers` (`tracking.py`), so
the trackers work wherever the ranks run. `check_trackers` turns `trackers=` into them, each one's
package checked as installed before any rank starts.
"""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from typing import Any

from ..common.errors import NbtrainError
from .tracker_writers import MLflowWriter, TensorBoardWriter, WandBWriter, Writer

# MLflow's own HTTP settings, for the run (ranks; restored after an in-process run), unless the
# user set them: each request given 10 s and tried 3 times, 2 s apart, so a tracking server that
# does not answer fails the run in about 30 s. MLflow's defaults (120 s, 7 retries, back-off
# factor 2) gave about 250 s of silence for a closed port and some 20 minutes for a silent one.
MLFLOW_HTTP = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0"}


class TrackerError(NbtrainError, RuntimeError):
    """A tracker could not start or write: one line naming it, where it writes, and why."""


def _path_setting(value) -> bool:
    return value is None or isinstance(value, (str, os.PathLike)) and bool(os.fspath(value))


def _text_setting(value, optional: bool = False) -> bool:
    return (optional and value is None) or isinstance(value, str) and bool(value.strip())


def _require(module: str, extra: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"trackers={what!r} needs the {module} package, which is not installed: "
                          f"pip install 'nbtrain[{extra}]'")


class Tracker:
    """What every tracker's settings object is: `TensorBoard`, `MLflow`, `WandB`. A tracker names its
    package (`module`, installed by nbtrain's `extra`), opens one writer per rank and says where it
    writes; the ranks' `Trackers` drive them alike."""
    name: str  # what trackers= takes for it, in words
    extra: str  # pip install 'nbtrain[extra]'
    module: str  # the package that must be installed
    client: str  # the module the writers import
    shared = False  # the ranks write into rank 0's run, whose id is handed round at the start
    environment: dict[str, str] = {}  # set in the rank for the run, where the user set none

    def opened(self, run) -> Writer:
        """This rank's writer for the run (a rank calls it).

        Parameters
        ----------
        run : RunInfo
            The run (its directory), as the rank knows it.

        Returns
        -------
        writer
        """
        raise NotImplementedError

    def where(self, run) -> str:
        """Where it writes, in words (errors name it).

        Parameters
        ----------
        run : RunInfo
            The run (its directory), as the rank knows it.

        Returns
        -------
        str
        """
        raise NotImplementedError


@dataclass(frozen=True)
class TensorBoard(Tracker):
    """TensorBoard event files of a run: ``launch(fn, trackers=[nbtrain.TensorBoard(...)])``.

    Written by torch.utils.tensorboard's SummaryWriter in the ranks: values logged with
    ``sync_dist=True`` by rank 0 under their name, the others by each rank as ``name/rank{N}``.
    The run's settings (strategy, devices, the function's arguments) are its hyper-parameters.
    ``trackers="tensorboard"`` is this with its defaults.

    Parameters
    ----------
    log_dir : str or Path, optional
        Where rank 0 writes (rank N > 0 in its ``rank{N}/``); default the run directory's
        ``tensorboard/``.

    Raises
    ------
    ValueError
        ``log_dir`` is not a path.
    """
    log_dir: str | None = None
    name = "tensorboard"
    extra = "tensorboard"
    module = "tensorboard"
    client = "torch.utils.tensorboard"

    def __post_init__(self):
        if not _path_setting(self.log_dir):
            raise ValueError(f"TensorBoard(log_dir={self.log_dir!r}): give a directory path (a str or "
                             "pathlib.Path), or None for the run directory's tensorboard/.")

    def opened(self, run) -> TensorBoardWriter:
        return TensorBoardWriter(self, run)

    def where(self, run) -> str:
        return f"TensorBoard in {os.fspath(self.log_dir or f'{run.dir}/tensorboard')}"


@dataclass(frozen=True)
class MLflow(Tracker):
    """One MLflow run for a launch: ``launch(fn, trackers=[nbtrain.MLflow(...)])``.

    Every rank writes into rank 0's MLflow run: values logged with ``sync_dist=True`` under
    their name, the others as ``name/rank{N}``; the run's settings are its parameters. A
    tracking server that does not answer fails the run within a minute, naming it.
    ``trackers="mlflow"`` is this with its defaults.

    Parameters
    ----------
    tracking_uri : str, optional
        ``'http://host:5000'``, ``'sqlite:///path/mlflow.db'``...; default ``MLFLOW_TRACKING_URI``
        as the notebook has it, else a SQLite file in the run directory.
    experiment : str, default 'nbtrain'
        The experiment's name.
    run_name : str, optional
        The MLflow run's name; default the run directory's name.

    Raises
    ------
    ValueError
        A setting is not a non-empty str.
    """
    tracking_uri: str | None = None
    experiment: str = "nbtrain"
    run_name: str | None = None
    name = "mlflow"
    extra = "mlflow"
    module = "mlflow"
    client = "mlflow"
    shared = True
    environment = MLFLOW_HTTP

    def __post_init__(self):
        if not _text_setting(self.tracking_uri, optional=True):
            raise ValueError(f"MLflow(tracking_uri={self.tracking_uri!r}): give a tracking URI such as "
                             "'http://host:5000' or 'sqlite:///path/mlflow.db', or None (MLFLOW_TRACKING_URI, else "
                             "a SQLite file in the run directory).")
        if not _text_setting(self.experiment):
            raise ValueError(f"MLflow(experiment={self.experiment!r}): give the experiment's name, a non-empty str.")
        if not _text_setting(self.run_name, optional=True):
            raise ValueError(f"MLflow(run_name={self.run_name!r}): give a non-empty str, or None for the run "
                             "directory's name.")

    def opened(self, run) -> MLflowWriter:
        return MLflowWriter(self, run)

    def uri(self, run) -> str:
        """The tracking URI the run writes to.

        Parameters
        ----------
        run : RunInfo
            The run (its directory), as the rank knows it.

        Returns
        -------
        str
        """
        return self.tracking_uri or f"sqlite:///{run.dir}/mlflow.db"

    def where(self, run) -> str:
        return f"MLflow at {self.uri(run)}"


@dataclass(frozen=True)
class WandB(Tracker):
    """Weights & Biases runs for a launch: ``launch(fn, trackers=[nbtrain.WandB(...)])``.

    One W&B run per rank that writes, grouped under the launch's name: values logged with
    ``sync_dist=True`` by rank 0, the others by each rank. ``trackers="wandb"`` is this with its
    defaults.

    Parameters
    ----------
    project : str, default 'nbtrain'
        The W&B project.
    mode : {'online', 'offline', 'disabled', 'shared'}, optional
        W&B's mode; 'offline' writes only local files (``wandb sync`` uploads them later). None:
        ``WANDB_MODE``, else W&B's default.
    entity : str, optional
        The W&B user or team; None: your default.
    dir : str or Path, optional
        Where W&B writes its files; default the run directory.

    Raises
    ------
    ValueError
        A setting is not accepted.
    """
    project: str = "nbtrain"
    mode: str | None = None  # "online", "offline", "disabled"; None: W&B's own default (WANDB_MODE)
    entity: str | None = None
    dir: str | None = None  # default: the run directory
    name = "wandb"
    extra = "wandb"
    module = "wandb"
    client = "wandb"
    MODES = ("online", "offline", "disabled", "shared")

    def __post_init__(self):
        if not _text_setting(self.project):
            raise ValueError(f"WandB(project={self.project!r}): give the project's name, a non-empty str.")
        if self.mode is not None and self.mode not in self.MODES:
            raise ValueError(f"WandB(mode={self.mode!r}): give one of {', '.join(map(repr, self.MODES))}, or None "
                             "(WANDB_MODE, else W&B's default).")
        if not _text_setting(self.entity, optional=True):
            raise ValueError(f"WandB(entity={self.entity!r}): give a W&B user or team name, or None (your default).")
        if not _path_setting(self.dir):
            raise ValueError(f"WandB(dir={self.dir!r}): give a directory path (a str or pathlib.Path), or None for "
                             "the run directory.")

    def opened(self, run) -> WandBWriter:
        return WandBWriter(self, run)

    def where(self, run) -> str:
        mode = self.mode or os.environ.get("WANDB_MODE") or "online"
        server = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")
        return f"W&B ({mode}{f', {server}' if mode in ('online', 'shared') else ''}) in {self.dir or run.dir}"


KINDS = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB}
ACCEPTED = ("Accepted: 'tensorboard', 'mlflow', 'wandb', nbtrain.TensorBoard(...), nbtrain.MLflow(...), "
            "nbtrain.WandB(...), or a list of them.")


def check_trackers(trackers) -> tuple:
    """`trackers=` as settings objects, each one's package checked as installed (in the notebook,
    so a missing one is said before any rank starts)."""
    if trackers is None or trackers == ():
        return ()
    given = [trackers] if isinstance(trackers, (str, Tracker)) else trackers
    try:
        given = list(given)
    except TypeError:
        raise ValueError(f"trackers={trackers!r} is not a tracker. {ACCEPTED}") from None
    found: list[Any] = []
    for tracker in given:
        if isinstance(tracker, str):
            kind = KINDS.get(tracker.strip().lower())
            if kind is None:
                raise ValueError(f"trackers={tracker!r} is not a tracker nbtrain knows. {ACCEPTED}")
            tracker = kind()
        elif not isinstance(tracker, Tracker):
            raise ValueError(f"trackers={tracker!r} is not a tracker. {ACCEPTED}")
        _require(tracker.module, tracker.extra, tracker.name)
        found.append(tracker)
    names = [t.name for t in found]
    if len(set(names)) != len(names):
        raise ValueError(f"trackers={names!r} names a tracker twice; give each once (settings in its object).")
    return tuple(found)
