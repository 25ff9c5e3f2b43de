"""The supervisor of a submitted run: a process in its own session that outlives the kernel.

It runs the job with `launch` itself, as a kernel would, so a submitted run starts its ranks,
watches them and names failures exactly as `launch` does (every placement, the same
`WorkerError`); its display (`display/recorder.py`) writes what the ranks report to the run
directory instead of drawing it. With `max_restarts`, a failed attempt starts all ranks again.
`submit.py` starts it: `python -c "from nbtrain.notebook.detached.supervise import main; main(RUN_DIR)"`,
so the job's `__main__` is a blank module, as in a spawned rank.

Nothing of the run is written in part: a result or error that cannot be written whole makes the
run `failed`, its reason the file and how far the write got. If even status.json cannot be
written, the supervisor says so in supervisor.log and exits non-zero, and the run reads failed
(a supervisor that ended with the run still active). It records its own identity
(supervisor.json) before anything else, so a run is never out of `cancel()`'s reach, whatever
moment the kernel that submitted it was killed at.
"""
from __future__ import annotations

import functools
import io
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from ...common import kernel_watcher, runlog, session
from ...common.devices import plan_devices
from ...common.errors import WorkerError
from ...common.pickling import ship_bytes
from ...common.process_tree import become_subreaper, end_descendants
from ...common.transfer import unpack_job
from ...display.recorder import RunRecorder
from ..run import steer_files
from ..run.background import BackgroundRun
from ..run.choices import IN_KERNEL, choose
from ..run.launch import launch
from ..run.options import RunOptions
from ..run.restarts import restart_loop, why


class StatusLost(Exception):
    """status.json could not be written: the run cannot say where it stands, so it ends."""


class Status:
    """status.json, rewritten whole at each change."""

    def __init__(self, run_dir: Path, max_restarts: int):
        self.path = run_dir / runlog.STATUS
        self.value: dict[str, Any] = {"status": "queued", "pid": os.getpid(), "max_restarts": max_restarts,
                                      "restarts": [], "reason": "", "ended": None}

    def set(self, status: str, **more) -> None:
        self.value.update(status=status, **more)
        if status in runlog.ENDED:
            self.value["ended"] = time.time()
        try:
            runlog.write_json(self.path, self.value)
        except OSError as error:
            raise StatusLost(str(error)) from error

    def events_stopped(self, reason: str) -> None:
        """The recorder's logs stopped: said in status.json now if it can be written (else with
        its next change), and in supervisor.log; never an error, the training goes on."""
        self.value["events_stopped"] = reason
        _say(f"nbtrain note: event logging stopped ({reason}); the run goes on")
        try:
            runlog.write_json(self.path, self.value)
        except OSError:
            pass


def _say(line: str) -> None:
    """A line in supervisor.log (our stderr), if the disk takes it. Lines that say why the run
    ended begin "nbtrain: " (`Run` quotes the last one when the supervisor has gone); others
    "nbtrain note: "."""
    try:
        os.write(2, (line + "\n").encode())
    except OSError:
        pass


class _RankZeroOutput(io.TextIOBase):
    """The supervisor's stdout or stderr while it runs a one-process job itself (strategies single
    and dp run in the caller, as in a kernel): each whole line is rank 0's output, also in the log."""

    def __init__(self, stream: str, original, recorder: RunRecorder):
        self.stream, self.original, self.recorder, self.partial = stream, original, recorder, ""

    def write(self, text: str) -> int:
        try:
            self.original.write(text)
        except OSError:  # supervisor.log on a full disk: the line is still in the event log, if that has room
            pass
        *lines, self.partial = (self.partial + text).split("\n")
        for line in lines:
            self.recorder.output(0, self.stream, line)
        return len(text)

    def flush(self) -> None:
        try:
            self.original.flush()
        except OSError:
            pass


def _in_process(options: RunOptions, cluster) -> bool:
    if cluster is not None:
        return False
    plan = plan_devices(options.devices, options.accelerator, options.backend, options.num_nodes)
    return choose(options.asked, plan).start == IN_KERNEL


def main(run_dir: str | Path, load=None, echo=None) -> int:
    """Run the job in `run_dir` (run.json written there) to its end; 0 if it finished. `load()`
    gives (fn, args, kwargs, objects) where the job is not job.pkl (an exported job's job.py);
    `echo` is a display that draws the run as well (an exported job's terminal)."""
    run_dir = Path(run_dir)
    # Who we are, first: a kernel killed before it recorded us leaves a run cancel() still finds.
    job = os.environ.get("SLURM_JOB_ID") if os.environ.get("NBTRAIN_SUPERVISOR_JOB") else None
    try:
        runlog.write_json(run_dir / runlog.SUPERVISOR, {"slurm_job": job} if job else session.identity(os.getpid()))
        if runlog.read_json(run_dir / runlog.STATUS, "status")["status"] in runlog.ENDED:
            _say("nbtrain: the run was cancelled before its supervisor started")  # cancel() found no supervisor
            return 1
    except (OSError, ValueError) as error:
        _say(f"nbtrain: the run cannot start: {error}")
        return 3
    # Its first line (on most file systems this also takes the block the later ones go to, so a
    # disk that fills during the run still has room for why the run ended).
    _say(f"nbtrain note: the supervisor ({f'SLURM job {job}' if job else f'pid {os.getpid()}'}) runs the job in "
         f"{run_dir}")
    # What the run's processes leave behind (orphans, a session of their own) comes to us, and
    # is ended with the run, however it ends.
    become_subreaper()
    try:
        return _supervise(run_dir, load or (lambda: _load(run_dir)), echo)
    except StatusLost as error:
        _say(f"nbtrain: the run's status cannot be written ({error}); the supervisor ends here and the run "
             "reads failed")
        return 3
    finally:
        end_descendants()  # the kernel watcher a launch started with the rest: its directory is ours to remove
        kernel_watcher.remove_own()


def _load(run_dir: Path) -> tuple:
    fn, args, kwargs = unpack_job(runlog.read_own(run_dir / runlog.JOB))
    return fn, args, kwargs, runlog.read_pickle(run_dir / runlog.OBJECTS)  # cluster, trackers, profile


def _supervise(run_dir: Path, load, echo) -> int:
    # cancel() sends SIGTERM (scancel too): the running launch takes it as a Ctrl-C, stops its
    # ranks and cleans up. Which of the two it was is kept, for the status's reason.
    signals: list[int] = []

    def interrupted(signum, frame):
        signals.append(signum)
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    signal.signal(signal.SIGINT, interrupted)
    if os.environ.pop("NBTRAIN_SUPERVISOR_JOB", None):
        # A SLURM batch job of its own: the ranks' job it submits must not inherit this one's
        # settings (srun reads SLURM_CPUS_PER_TASK, SLURM_NTASKS... from its environment).
        for name in [n for n in os.environ if n.startswith(("SLURM_", "SBATCH_", "SRUN_")) and n != "SLURM_CONF"]:
            del os.environ[name]
    spec = runlog.read_spec(run_dir / runlog.SPEC, "max_restarts", "launch")
    status = Status(run_dir, spec["max_restarts"])
    os.environ["NBTRAIN_RUN_DIR"] = str(run_dir)  # ctx.run_dir, in every rank (their environment starts from ours)
    try:
        fn, args, kwargs, objects = load()
        if "wait" in kwargs:  # the function's own (a job submitted before launch took `wait=`): bound to it
            fn = functools.partial(fn, wait=kwargs.pop("wait"))
        sweeping = spec.get("kind") == "sweep"
        options = None if sweeping else RunOptions.from_spec(spec["launch"])
        in_process = options is not None and _in_process(options, objects["cluster"])
    except BaseException as exc:
        return _failed(run_dir, status, exc, "the job could not be loaded")
    if sweeping:
        # No view: its lines begin "nbtrain: ", which supervisor.log keeps for why a run ended; the
        # study is the sweep's record (the Run lists its trials from it).
        return _sweep(run_dir, status, signals, lambda: fn(*args, run_dir=str(run_dir), progress=False, **kwargs))
    cluster = objects["cluster"]

    def queued(where: str | None) -> None:  # where the cluster holds the ranks; None once they run
        if where is None:
            status.set("running", reason="")
        else:
            status.set("queued", reason=f"waiting for the ranks to start: {where}")

    summary = {"devices": "", "ranks": [], "metrics": {}}  # summary.json, kept across attempts
    recorder: RunRecorder | None = None  # the attempt's, until it is closed

    def attempt(n: int):
        nonlocal recorder
        # On a cluster the run is queued until its ranks run (a SLURM job may wait for hours).
        status.set("running" if cluster is None else "queued", attempt=n,
                   reason="" if cluster is None else f"starting the ranks on {cluster.where()}")
        recorder = RunRecorder(run_dir, n, queued=None if cluster is None else queued, echo=echo,
                               summary=summary, stopped=None if status.value.get("events_stopped")
                               else status.events_stopped)
        if status.value.get("events_stopped"):  # stopped in an earlier attempt: the disk is still suspect
            recorder.stopped = status.value["events_stopped"]
        streams = sys.stdout, sys.stderr
        if in_process:
            sys.stdout, sys.stderr = (_RankZeroOutput(name, stream, recorder)
                                      for name, stream in zip(("stdout", "stderr"), streams))
        try:
            # A run of rank processes here runs in the background, steered from any kernel (`steer_files.py`).
            steerable = cluster is None and not in_process
            assert options is not None  # not a sweep
            ran = launch(fn, *args, progress=recorder, run_dir=str(run_dir), **objects, **options.keywords(),
                         wait=not steerable, **kwargs)
            return steer_files.serve(ran, run_dir) if isinstance(ran, BackgroundRun) else ran
        except KeyboardInterrupt:
            recorder.note("cancelled")
            raise
        finally:
            sys.stdout, sys.stderr = streams

    def between(said: str, reason: str) -> None:  # status.json reads "restarting (2 of 5) in 2 s: ..." meanwhile
        nonlocal recorder
        assert recorder is not None, "an attempt failed"
        recorder.note(said)
        status.set("restarting", reason=said, restarts=[*status.value["restarts"], reason])
        recorder.close()
        recorder = None

    def restartable(error: Exception) -> bool:
        # On a cluster only the ranks' failures restart (as in launch): a job SLURM refuses would only repeat.
        # A status that cannot be written ends the run (`main`).
        return not isinstance(error, StatusLost) and (cluster is None or isinstance(error, WorkerError))

    try:
        result, _ = restart_loop(attempt, spec["max_restarts"], between, restartable)
    except StatusLost:
        raise
    except KeyboardInterrupt:  # cancel() (or Ctrl-C), while an attempt ran or while waiting to restart
        status.set("cancelled", reason=_cancelled(signals))
        return 1
    except Exception as error:  # a WorkerError; in the supervisor itself (single, dp), the code's own
        return _failed(run_dir, status, error, why(error))
    finally:
        if recorder is not None:
            recorder.close()
    result.restarts = list(status.value["restarts"])
    return _finished(run_dir, status, result)


def _sweep(run_dir: Path, status: Status, signals: list[int], run) -> int:
    """A submitted sweep (`submit(nbtrain.sweep, ...)`): `run()` is the sweep, its study SQLite in
    the run directory, its trials launches of their own. The result is the `Sweep` (its study
    reopens the database where it is read back)."""
    status.set("running", attempt=0, reason="")
    try:
        result = run()
    except KeyboardInterrupt:  # the finished trials are kept in the study
        status.set("cancelled", reason=_cancelled(signals))
        return 1
    except Exception as error:
        return _failed(run_dir, status, error, why(error))
    finally:
        sys.stdout.flush()
    return _finished(run_dir, status, result)


def _finished(run_dir: Path, status: Status, result) -> int:
    """The run's result to result.pkl, whole (a full disk, a file-size limit: the result is lost,
    and the run fails saying how), then 'finished'."""
    try:
        runlog.write_whole(run_dir / runlog.RESULT, ship_bytes(result))
    except Exception as error:
        reason = str(error) if isinstance(error, runlog.IncompleteWrite) else f"{runlog.RESULT}: {error}"
        return _failed(run_dir, status, None, reason)
    status.set("finished", reason="")
    return 0


def _cancelled(signals: list[int]) -> str:
    return "interrupted (Ctrl-C)" if signals[:1] == [signal.SIGINT] else "cancelled by Run.cancel() (SIGTERM)"


def _failed(run_dir: Path, status: Status, error: BaseException | None, reason: str) -> int:
    """The run failed: `error` (the exception to raise in the notebook; None: the reason says it
    all) to error.pkl, if it can be written whole, and the reason to status.json."""
    if error is None:
        _say(f"nbtrain: the run failed: {reason}")
    else:
        try:
            traceback.print_exception(error, file=sys.stderr)
        except OSError:
            pass
        try:
            payload = ship_bytes(error)
        except Exception:  # an exception that does not pickle: its text still reaches the notebook
            payload = ship_bytes(RuntimeError("".join(traceback.format_exception(error))))
        try:
            runlog.write_whole(run_dir / runlog.ERROR, payload)
        except OSError as lost:  # the reason in status.json still says what failed
            reason = f"{reason} (the error itself was not kept: {lost})"
    status.set("failed", reason=reason)
    return 1
