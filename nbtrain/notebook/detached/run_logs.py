"""What a submitted run's logs and records say of it: its summary (devices, ranks, rank 0's last
metrics), its ranks, what a rank printed, the changes its last attempt made, a submitted sweep's
trials. Everything is read from the run directory (`common/runlog.py`); logs are read from their
ends where only their last events are wanted, so a huge log costs no more than a small one."""
from __future__ import annotations

from pathlib import Path
from typing import Any

from ...common import protocol, runlog
from ...common.private import check_own

SUMMARY_METRICS = 1000  # the last metric events a run without summary.json is summed up from


def summary(run_dir: Path, from_logs: bool = True) -> dict:
    """devices, ranks and rank 0's last metrics: summary.json (the supervisor's recorder keeps
    it), or for a run written before it was (or before its first), the logs."""
    path = run_dir / runlog.SUMMARY
    try:
        value = runlog.read_json(path, "devices", "ranks", "metrics")
    except FileNotFoundError:
        if not from_logs:
            raise
        return summary_from_logs(run_dir)
    if not isinstance(value["metrics"], dict) or not isinstance(value["ranks"], list):
        raise ValueError(f"{str(path)!r} is damaged: its metrics or ranks are not what the recorder writes")
    return value


def summary_from_logs(run_dir: Path) -> dict:
    value: dict[str, Any] = {"devices": "", "ranks": [], "metrics": {}}
    # The last attempt's start, the latest metrics (a bounded number of them).
    for _, event in runlog.last_events(run_dir / runlog.EVENTS, 1, protocol.AttemptStarted):
        if isinstance(event.title, str) and isinstance(event.ranks, list):
            value.update(devices=event.title.split(" on ", 1)[-1], ranks=event.ranks)
    for _, event in runlog.last_events(run_dir / runlog.rank_events(0), SUMMARY_METRICS, protocol.Metric):
        value["metrics"][runlog.metric_name(event.name)] = event.value
    return value


def ranks_of(run_dir: Path) -> list:
    """The run's ranks: from summary.json, or where that is damaged or missing, from the last
    attempt's start in the run's log (read from its end)."""
    try:
        return summary(run_dir, from_logs=False)["ranks"]
    except (ValueError, OSError):
        started = runlog.last_events(run_dir / runlog.EVENTS, 1, protocol.AttemptStarted)
        ranks = started[0].event.ranks if started else []
        return ranks if isinstance(ranks, list) else []


def printed(run_dir: Path, rank: int, last: int | None) -> str:
    """What `rank` printed, every attempt's (only the `last` lines, if given), as text."""
    path = run_dir / runlog.rank_events(rank)
    if last is not None:
        lines = [event.text for _, event in runlog.last_events(path, last, protocol.Output)]
    else:
        lines = [event.text for _, event in runlog.Tail(path).read() if isinstance(event, protocol.Output)]
    return "".join(f"{line}\n" for line in lines)


def last_changes(run_dir: Path) -> list:
    """The steering changes of the run's last attempt (a restart's, not its first attempt's)."""
    logged = runlog.Tail(run_dir / runlog.EVENTS).read()
    last = max((attempt for attempt, _ in logged), default=None)
    return [e for a, e in logged if a == last and isinstance(e, protocol.Change)]


def sweep_trials(run_dir: Path) -> list[str]:
    """A submitted sweep's trials as its study holds them, a line each (none before it began)."""
    path = run_dir / runlog.STUDY
    if not path.exists():
        return []
    try:
        check_own(path, "study database")
        import optuna  # only for a sweep, which needed it to run
        from sqlalchemy.pool import NullPool

        storage = optuna.storages.RDBStorage(f"sqlite:///{path}", engine_kwargs={"poolclass": NullPool})
        study = optuna.load_study(study_name=None, storage=storage)
        trials = study.get_trials(deepcopy=False)
    except Exception as error:  # a study still being made, or damaged: said, never raised from a repr
        return [f"(the study cannot be read now: {type(error).__name__}: {error})"]
    return [f"trial {t.number}  {t.state.name.lower()}  " + "  ".join(f"{k}={v:.4g}" if isinstance(v, float) else
                                                                     f"{k}={v}" for k, v in t.params.items())
            + ("" if t.value is None else f"  value={t.value:.4g}") for t in trials]
