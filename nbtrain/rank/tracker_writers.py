"""One rank's writer of each tracker: TensorBoard's SummaryWriter, an MLflow client, a W&B run.

Each tracker's own client writes its files; nothing here knows their formats. Values logged with
`sync_dist=True` come as their name (rank 0 alone writes them), other values as `name/rank{N}`
(`tracking.Trackers` names them). A writer is opened from its settings object (`trackers.py`).
"""
from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from ..common.private import new_private_dir, new_private_file, private_files

if TYPE_CHECKING:
    from .trackers import MLflow, TensorBoard, WandB

FLUSH_SECONDS = 1.0  # MLflow: metrics are sent in batches at most this often (one store write each)
# W&B's settings where the user set none (WANDB_INIT_TIMEOUT, WANDB_FINISH_TIMEOUT): its
# default waits 90 s to start and, at the end, until every upload is done, however long.
WANDB_TIMEOUTS = {"init_timeout": 30.0, "finish_timeout": 120.0}


class Writer:
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


class TensorBoardWriter(Writer):
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


class MLflowWriter(Writer):
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


class WandBWriter(Writer):
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
