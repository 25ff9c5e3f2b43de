"""Experiment trackers fed by `ctx.log`: TensorBoard, MLflow and Weights & Biases, written by the ranks.

The settings objects (`TensorBoard`, `MLflow`, `WandB`) are plain data made in the notebook; each
rank opens its writer from them, so the trackers work wherever the ranks run. Values logged with
`sync_dist=True` are the same on every rank: rank 0 alone writes them under their name. Other
values are each rank's own, written as `name/rank{N}` by that rank. Each tracker's own client
writes its files; nothing here knows their formats.
"""
from __future__ import annotations

import importlib
import importlib.util
import queue
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from ..common.private import new_private_dir, new_private_file, private_files

FLUSH_SECONDS = 1.0  # MLflow: metrics are sent in batches at most this often (one store write each)


def _require(module: str, extra: str, what: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ImportError(f"trackers={what!r} needs the {module} package, which is not installed: "
                          f"pip install 'nbtrain[{extra}]'")


@dataclass(frozen=True)
class TensorBoard:
    """TensorBoard event files (torch.utils.tensorboard's SummaryWriter) in `log_dir` (default: the
    run directory's `tensorboard/`); rank 0 writes there, rank N>0 in its `rank{N}/`."""
    log_dir: str | None = None
    name = "tensorboard"
    extra = "tensorboard"
    module = "tensorboard"
    client = "torch.utils.tensorboard"

    def opened(self, run) -> "_TensorBoardWriter":
        return _TensorBoardWriter(self, run)


@dataclass(frozen=True)
class MLflow:
    """One MLflow run in `experiment` (default "nbtrain") at `tracking_uri` (default:
    MLFLOW_TRACKING_URI as the notebook has it, else a SQLite file in the run directory)."""
    tracking_uri: str | None = None
    experiment: str = "nbtrain"
    run_name: str | None = None
    name = "mlflow"
    extra = "mlflow"
    module = "mlflow"
    client = "mlflow"
    shared = True  # the ranks write into rank 0's run: its id is handed round at the start

    def opened(self, run) -> "_MLflowWriter":
        return _MLflowWriter(self, run)


@dataclass(frozen=True)
class WandB:
    """Weights & Biases runs, one per rank writing, grouped under the run's name; `mode="offline"`
    writes only local files (`wandb sync` uploads them later)."""
    project: str = "nbtrain"
    mode: str | None = None  # "online", "offline", "disabled"; None: W&B's own default (WANDB_MODE)
    entity: str | None = None
    dir: str | None = None  # default: the run directory
    name = "wandb"
    extra = "wandb"
    module = "wandb"
    client = "wandb"

    def opened(self, run) -> "_WandBWriter":
        return _WandBWriter(self, run)


KINDS = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB}
ACCEPTED = ("Accepted: 'tensorboard', 'mlflow', 'wandb', nbtrain.TensorBoard(...), nbtrain.MLflow(...), "
            "nbtrain.WandB(...), or a list of them.")


def check_trackers(trackers) -> tuple:
    """`trackers=` as settings objects, each one's package checked as installed (in the notebook,
    so a missing one is said before any rank starts)."""
    if trackers is None or trackers == ():
        return ()
    given = [trackers] if isinstance(trackers, (str, *KINDS.values())) else trackers
    try:
        given = list(given)
    except TypeError:
        raise ValueError(f"trackers={trackers!r} is not a tracker. {ACCEPTED}") from None
    found = []
    for tracker in given:
        if isinstance(tracker, str):
            kind = KINDS.get(tracker.strip().lower())
            if kind is None:
                raise ValueError(f"trackers={tracker!r} is not a tracker nbtrain knows. {ACCEPTED}")
            tracker = kind()
        elif not isinstance(tracker, tuple(KINDS.values())):
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

    def close(self, failed: bool = False) -> None:
        pass


class _TensorBoardWriter(_Writer):
    def __init__(self, settings: TensorBoard, run):
        from torch.utils.tensorboard import SummaryWriter
        from torch.utils.tensorboard.summary import hparams

        # Private: the event file records the run's arguments.
        base = new_private_dir(settings.log_dir or f"{run.dir}/tensorboard")
        self.writer = SummaryWriter(str(base if run.rank == 0 else new_private_dir(base / f"rank{run.rank}")))
        private_files(self.writer.log_dir)
        if run.rank == 0:
            # What add_hparams writes, into this writer's own file: add_hparams opens a second
            # writer (a second run in TensorBoard) for them.
            for summary in hparams(_plain(run.settings), {}):
                self.writer.file_writer.add_summary(summary)

    def log(self, key: str, value: float, step: int) -> None:
        self.writer.add_scalar(key, value, step)

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class _MLflowWriter(_Writer):
    def __init__(self, settings: MLflow, run):
        from mlflow import MlflowClient

        if settings.tracking_uri is None:  # private: the store records the run's arguments
            new_private_file(f"{run.dir}/mlflow.db")
        uri = settings.tracking_uri or f"sqlite:///{run.dir}/mlflow.db"
        self.client = MlflowClient(tracking_uri=uri)
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
        if len(self.pending) >= 500 or time.monotonic() - self.sent >= FLUSH_SECONDS:
            self._flush()

    def _flush(self) -> None:
        if self.pending:
            self.client.log_batch(self.run_id, metrics=self.pending)
        self.pending, self.sent = [], time.monotonic()

    def close(self, failed: bool = False) -> None:
        self._flush()
        if self.run_id and self.owner:
            self.client.set_terminated(self.run_id, "FAILED" if failed else "FINISHED")


class _WandBWriter(_Writer):
    def __init__(self, settings: WandB, run):
        import wandb

        name = run.name if run.rank == 0 else f"{run.name}-rank{run.rank}"
        new_private_dir(Path(settings.dir or run.dir, "wandb"))  # W&B's own folder there: private
        self.run = wandb.init(project=settings.project, entity=settings.entity, mode=settings.mode,
                              dir=settings.dir or run.dir, name=name, group=run.name, job_type=f"rank{run.rank}",
                              config=run.settings if run.rank == 0 else {"rank": run.rank}, reinit="create_new")
        # Each name keeps its own step (ctx.log counts per name): W&B's own step would tie them together.
        self.run.define_metric("*", step_metric="step")

    def log(self, key: str, value: float, step: int) -> None:
        self.run.log({key: value, "step": step})

    def close(self, failed: bool = False) -> None:
        import wandb

        self.run.finish(exit_code=1 if failed else 0)
        wandb.teardown()  # its wandb-core process ends now, not some time after this rank


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
    queue put, and the writing overlaps the loop's torch operators (which release the GIL)."""

    def __init__(self, settings: tuple, run: RunInfo):
        self.settings, self.run = settings, run
        self.writers: dict[str, _Writer] = {}
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.error: BaseException | None = None  # the first a writer raised: raised again by close()
        self.thread = threading.Thread(target=self._write, name="nbtrain-trackers", daemon=True)

    def start(self, share) -> None:
        """Open rank 0's writers; `share(value)` hands rank 0's value to every rank (a collective)."""
        for tracker in self.settings:
            # Imported now on every rank (about a second for some): not in the middle of training,
            # when a rank's first value of its own opens its writer.
            importlib.import_module(tracker.client)
        if self.run.rank == 0:
            for tracker in self.settings:
                self._writer(tracker)
        for tracker in self.settings:
            if getattr(tracker, "shared", False):
                run_id = share(self.writers[tracker.name].run_id if self.run.rank == 0 else None)
                if self.run.rank != 0:
                    self._writer(tracker).join(run_id)
        self.thread.start()

    def _writer(self, tracker) -> _Writer:
        writer = self.writers.get(tracker.name)
        if writer is None:
            writer = self.writers[tracker.name] = tracker.opened(self.run)
        return writer

    def log(self, name: str, value: float, step: int, synced: bool) -> None:
        if synced and self.run.rank != 0:
            return  # the same value on every rank: rank 0 writes it once
        self.queue.put((name if synced else f"{name}/rank{self.run.rank}", value, step))

    def _write(self) -> None:
        while (item := self.queue.get()) is not None:
            if self.error is not None:
                continue  # a writer failed: the rest is dropped, close() says why
            try:
                for tracker in self.settings:
                    self._writer(tracker).log(*item)
            except BaseException as exc:
                self.error = exc

    def close(self, failed: bool = False) -> None:
        if self.thread.is_alive():
            self.queue.put(None)
            self.thread.join()
        for writer in self.writers.values():
            writer.close(failed)
        self.writers.clear()
        if self.error is not None and not failed:
            raise RuntimeError(f"a tracker could not write: {type(self.error).__name__}: {self.error}") from self.error
