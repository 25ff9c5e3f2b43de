"""Experiment trackers fed by `ctx.log`: TensorBoard, MLflow and Weights & Biases, written by the ranks.

The settings objects (`TensorBoard`, `MLflow`, `WandB`) are plain data made in the notebook; each
rank opens its writer from them, so the trackers work wherever the ranks run. Values logged with
`sync_dist=True` are the same on every rank: rank 0 alone writes them under their name. Other
values are each rank's own, written as `name/rank{N}` by that rank. Each tracker's own client
writes its files; nothing here knows their formats.

Every wait on a tracker is bounded, and a tracker that fails is named with where it writes: a
server that does not answer fails the run within a minute (MLflow: each request given 10 s and 2
retries; W&B: its init and finish timeouts), a full disk is said as such. Values are written on a
thread of their own, so a slow tracker slows no training step; what queued up meanwhile goes in
one batch.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..common.errors import NbtrainError
from ..common.private import new_private_dir, new_private_file, private_files

FLUSH_SECONDS = 1.0  # MLflow: metrics are sent in batches at most this often (one store write each)
BATCH = 10_000  # values taken off the queue at once: what queued up while the last batch was written
# MLflow's own HTTP settings, for the run (ranks; restored after an in-process run), unless the
# user set them: each request given 10 s and tried 3 times, 2 s apart, so a tracking server that
# does not answer fails the run in about 30 s. MLflow's defaults (120 s, 7 retries, back-off
# factor 2) gave about 250 s of silence for a closed port and some 20 minutes for a silent one.
MLFLOW_HTTP = {"MLFLOW_HTTP_REQUEST_TIMEOUT": "10", "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
               "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_JITTER": "0"}
# W&B's settings where the user set none (WANDB_INIT_TIMEOUT, WANDB_FINISH_TIMEOUT): its
# default waits 90 s to start and, at the end, until every upload is done, however long.
WANDB_TIMEOUTS = {"init_timeout": 30.0, "finish_timeout": 120.0}
REFUSED, SILENT = "connection refused", "no answer in time"  # a server's two ways of not answering


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

    def opened(self, run) -> _Writer:
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

    def opened(self, run) -> _TensorBoardWriter:
        return _TensorBoardWriter(self, run)

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

    def opened(self, run) -> _MLflowWriter:
        return _MLflowWriter(self, run)

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

    def opened(self, run) -> _WandBWriter:
        return _WandBWriter(self, run)

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


class _Writer:
    """One rank's writer of one tracker. `key` is the name the value is written under."""

    def log(self, key: str, value: float, step: int) -> None:
        raise NotImplementedError

    def written(self) -> None:
        """A batch of values was logged: a writer that sends in batches may send now."""

    def close(self, failed: bool = False) -> None:
        pass

    def abandon(self) -> None:
        """This writer failed: release what it holds, asking nothing more of its store or server."""
        with contextlib.suppress(Exception):
            self.close(failed=True)


class _TensorBoardWriter(_Writer):
    def __init__(self, settings: TensorBoard, run):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        # Private: the event file records the run's arguments.
        base = new_private_dir(os.fspath(settings.log_dir or f"{run.dir}/tensorboard"))
        self.writer = SummaryWriter(str(base if run.rank == 0 else new_private_dir(base / f"rank{run.rank}")))
        private_files(self.writer.log_dir)
        if run.rank == 0:
            # What add_hparams writes, into this writer's own file: add_hparams opens a second
            # writer (a second run in TensorBoard) for them.
            for summary in hparams(_plain(run.settings), {}):
                self.writer.file_writer.add_summary(summary)  # type: ignore[attr-defined]  # open until close()

    def log(self, key: str, value: float, step: int) -> None:
        self.writer.add_scalar(key, value, step)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class _MLflowWriter(_Writer):
    def __init__(self, settings: MLflow, run):
        from mlflow import MlflowClient

        if settings.tracking_uri is None:  # private: the store records the run's arguments
            new_private_file(f"{run.dir}/mlflow.db")
        self.client = MlflowClient(tracking_uri=settings.uri(run))
        self.run_id = None
        self.owner = run.rank == 0  # the rank that created the run ends it
        self.pending: list = []
        self.sent = time.monotonic()
        if run.rank == 0:
            experiment = self.client.get_experiment_by_name(settings.experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self.client.create_experiment(settings.experiment))
            created = self.client.create_run(experiment_id, run_name=settings.run_name or run.name,
                                             tags={"nbtrain.world_size": str(run.world_size)})
            self.run_id = created.info.run_id
            self.client.log_batch(self.run_id, params=[_param(k, v) for k, v in run.settings.items()])

    def join(self, run_id: str) -> None:
        self.run_id = run_id

    def log(self, key: str, value: float, step: int) -> None:
        from mlflow.entities import Metric

        self.pending.append(Metric(key, value, int(time.time() * 1000), step))

    def written(self) -> None:
        if len(self.pending) >= 500 or time.monotonic() - self.sent >= FLUSH_SECONDS:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            assert self.run_id is not None  # set by start(), before any metric
            self.client.log_batch(self.run_id, metrics=self.pending)  # MLflow splits it into requests of 1,000
        self.pending, self.sent = [], time.monotonic()

    def close(self, failed: bool = False) -> None:
        self._flush()
        if self.run_id and self.owner:
            self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")

    def abandon(self) -> None:
        self.pending = []  # a store that failed once is not asked again: each try could wait its timeout


def wandb_timeouts(environ) -> dict[str, float]:
    """nbtrain's bounds on W&B's start and finish, less those the user set in `environ`."""
    return {k: v for k, v in WANDB_TIMEOUTS.items() if f"WANDB_{k.upper()}" not in environ}


class _WandBWriter(_Writer):
    def __init__(self, settings: WandB, run):
        import wandb

        name = run.name if run.rank == 0 else f"{run.name}-rank{run.rank}"
        bounded = wandb_timeouts(os.environ)
        new_private_dir(Path(os.fspath(settings.dir or run.dir), "wandb"))  # W&B's own folder there: private
        try:
            self.run = wandb.init(project=settings.project, entity=settings.entity,
                                  mode=settings.mode,  # type: ignore[arg-type]  # checked by W&B's settings
                                  dir=os.fspath(settings.dir or run.dir), name=name, group=run.name,
                                  job_type=f"rank{run.rank}",
                                  config=run.settings if run.rank == 0 else {"rank": run.rank},
                                  reinit="create_new", settings=wandb.Settings(finish_timeout_raises=True,
                                                                          **bounded))  # type: ignore[arg-type]
        except BaseException:
            _end_wandb()
            raise
        # Each name keeps its own step (ctx.log counts per name): W&B's own step would tie them together.
        self.run.define_metric("*", step_metric="step")

    def log(self, key: str, value: float, step: int) -> None:
        self.run.log({key: value, "step": step})

    def close(self, failed: bool = False) -> None:
        try:
            self.run.finish(exit_code=1 if failed else 0)
        finally:
            _end_wandb()


def _end_wandb() -> None:
    """End this rank's wandb-core now, not some time after the rank, and remove the socket of any
    system monitor it started that did not remove its own: wandb-core ends its monitor
    (wandb-symon) as the run finishes, and a monitor ended before it unlinks
    `wandb_symon-<core pid>-<monitor pid>-<ms>.sock` leaves that file in the temporary folder."""
    import tempfile

    import psutil
    import wandb

    cores = []  # this process's W&B service
    for child in psutil.Process().children():
        with contextlib.suppress(psutil.Error):  # a child that ended meanwhile
            if child.name() == "wandb-core":
                cores.append(child.pid)
    wandb.teardown()
    for core in cores:
        for sock in Path(tempfile.gettempdir()).glob(f"wandb_symon-{core}-*.sock"):
            with contextlib.suppress(OSError):
                if sock.lstat().st_uid == os.geteuid():  # a stranger's file is not ours to remove
                    sock.unlink()


def _plain(settings: dict) -> dict:
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in settings.items()}


def _param(key, value):
    from mlflow.entities import Param

    return Param(key, str(value)[:6000])


@dataclass
class RunInfo:
    """What a rank's writers need to know of the run."""
    name: str
    dir: str
    rank: int
    world_size: int
    settings: dict


class Trackers:
    """This rank's writers, opened from the settings: rank 0's at the start (they carry the
    hyper-parameters), another rank's when it first logs a value of its own. Values are written
    on a thread of their own: building a tracker's records costs the training loop nothing but a
    queue put, and the writing overlaps the loop's torch operators (which release the GIL). A
    tracker that fails is written to no more; close() raises its error, naming it."""

    def __init__(self, settings: tuple, run: RunInfo):
        self.settings, self.run = settings, run
        self.writers: dict[str, _Writer] = {}
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: TrackerError | None = None  # the first a writer raised: raised again by close()
        self.failed: str | None = None  # the name of the tracker that raised it
        self.thread = threading.Thread(target=self._write, name="nbtrain-trackers", daemon=True)
        self.added: list[str] = []  # what start() set in os.environ, for the run

    def start(self, share) -> None:
        """Open rank 0's writers; `share(value)` hands rank 0's value to every rank (a collective)."""
        for tracker in self.settings:
            # Before any thread of ours runs (os.environ is not safe to change beside one), for
            # the run only: close() restores it, as a run in the kernel's own process needs.
            for key, value in tracker.environment.items():
                if key not in os.environ:
                    self.added.append(key)
                    os.environ[key] = value
        for tracker in self.settings:
            # Imported now on every rank (about a second for some): not in the middle of training,
            # when a rank's first value of its own opens its writer.
            importlib.import_module(tracker.client)
        if self.run.rank == 0:
            for tracker in self.settings:
                self._writer(tracker)
        for tracker in self.settings:
            if tracker.shared:
                run_id = share(self.writers[tracker.name].run_id if self.run.rank == 0 else None)  # type: ignore[attr-defined]
                if self.run.rank != 0:
                    self._writer(tracker).join(run_id)  # type: ignore[attr-defined]  # shared: MLflow's writer
        self.thread.start()

    def _writer(self, tracker) -> _Writer:
        writer = self.writers.get(tracker.name)
        if writer is None:
            with self._said(tracker, "could not start"):
                writer = self.writers[tracker.name] = tracker.opened(self.run)
        return writer

    @contextlib.contextmanager
    def _said(self, tracker, doing: str):
        """A tracker's error as one line: what failed, where it writes, and why."""
        try:
            yield
        except TrackerError:
            raise
        except Exception as exc:
            reason = _reason(exc)
            if isinstance(tracker, MLflow) and reason in (REFUSED, SILENT):
                setting = {k: os.environ.get(k, v) for k, v in MLFLOW_HTTP.items()}
                reason += (f" (each request given {setting['MLFLOW_HTTP_REQUEST_TIMEOUT']} s, "
                           f"{setting['MLFLOW_HTTP_REQUEST_MAX_RETRIES']} retries: MLFLOW_HTTP_REQUEST_TIMEOUT, "
                           "MLFLOW_HTTP_REQUEST_MAX_RETRIES)")
            raise TrackerError(f"{tracker.where(self.run)} {doing}: {reason}") from exc

    def log(self, name: str, value: float, step: int, synced: bool) -> None:
        if synced and self.run.rank != 0:
            return  # the same value on every rank: rank 0 writes it once
        self.queue.put((name if synced else f"{name}/rank{self.run.rank}", value, step))

    def _write(self) -> None:
        done = False
        while not done:
            items = [self.queue.get()]
            while len(items) < BATCH and items[-1] is not None:
                try:
                    items.append(self.queue.get_nowait())
                except queue.Empty:
                    break
            done = items[-1] is None  # close() puts None last
            values = items[:-1] if done else items
            if self.error is not None or not values:
                continue  # a writer failed: the rest is dropped, close() says why
            for tracker in self.settings:
                try:
                    with self._said(tracker, "could not write"):
                        writer = self._writer(tracker)
                        for item in values:
                            writer.log(*item)
                        writer.written()
                except TrackerError as exc:
                    self.error, self.failed = exc, tracker.name
                    break

    def close(self, failed: bool = False) -> None:
        try:
            if self.thread.is_alive():
                self.queue.put(None)
                self.thread.join()  # bounded: each tracker's calls are
            for tracker in self.settings:
                writer = self.writers.pop(tracker.name, None)
                if writer is None:
                    continue
                if tracker.name == self.failed:
                    writer.abandon()
                    continue
                try:
                    with self._said(tracker, "could not finish"):
                        writer.close(failed)
                except TrackerError as exc:
                    self.error = self.error or exc
        finally:
            for key in self.added:
                os.environ.pop(key, None)
            self.added.clear()
        if self.error is not None and not failed:
            raise self.error


def _reason(exc: BaseException) -> str:
    """Why, in a few words: the system's own (no space left on device) where it gave them; for a
    server, whether it refused or did not answer; else the error's type and first line."""
    if isinstance(exc, OSError) and exc.strerror:
        said = exc.strerror[:1].lower() + exc.strerror[1:]
        return f"{said} ({exc.filename})" if exc.filename else said
    text = (str(exc).strip().splitlines() or [""])[0]
    lowered = text.lower()
    if "connection refused" in lowered:
        return REFUSED
    if "timed out" in lowered or "deadline exceeded" in lowered:
        return SILENT
    return f"{type(exc).__name__}: {text[:300]}" if text else type(exc).__name__
