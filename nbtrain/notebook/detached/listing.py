"""`runs()`: the table of the submitted runs under a folder, each row read from the run's summary
(never its logs); a run that cannot be read is a row saying why."""
from __future__ import annotations

import html
import os
from datetime import datetime
from pathlib import Path

from ...common import runlog
from ...common.private import NotYours, check_own
from .run_logs import summary as run_summary
from .run_status import current_status
from .runs import Run


class RunTable(list):
    """`runs()`: one dict per run; shown as a table (with each run's reason when one of them is
    damaged or refused)."""

    COLUMNS = ("run", "function", "started", "devices", "status", "metrics")

    def _columns(self) -> tuple:
        return self.COLUMNS + (("reason",) if any(r["status"] in PROBLEMS for r in self) else ())

    def __repr__(self) -> str:
        columns = self._columns()
        rows = [columns, *([str(r[c]) for c in columns] for r in self)]
        widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
        return "\n".join("  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in rows)

    def _repr_html_(self) -> str:
        columns = self._columns()
        head = "".join(f"<th style='text-align:left'>{c}</th>" for c in columns)
        body = "".join("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(str(r[c]))}</td>"
                                        for c in columns) + "</tr>" for r in self)
        return f"<table><tr>{head}</tr>{body}</table>"


PROBLEMS = ("damaged", "refused")  # a row's status when the run cannot be read, or is not ours to read


def runs(path="nbtrain-runs") -> RunTable:
    """The submitted runs under a folder, oldest first, as a table.

    Each row: function, started, devices, status and rank 0's last metrics, read from the
    run's summary (not its logs). A run that cannot be read is listed as damaged, one of
    another user or behind a symbolic link as refused, each with its reason; what an
    interrupted submit left behind is removed.

    Parameters
    ----------
    path : str or Path, default 'nbtrain-runs'
        The folder that holds run directories.

    Returns
    -------
    RunTable
        A list of rows (dicts), shown as a table.

    Raises
    ------
    TypeError
        ``path`` is not a path.
    ValueError
        ``path`` is a file, or a run directory itself (see it with `attach`).
    PermissionError
        ``path`` is another user's, or a symbolic link.
    """
    if not isinstance(path, (str, os.PathLike)) or not os.fspath(path):
        raise TypeError(f"runs(path={path!r}): give the folder that holds run directories (str or Path; by "
                        "default 'nbtrain-runs').")
    base = Path(path)
    table = RunTable()
    if not os.path.lexists(base):
        return table
    check_own(base, "folder")
    if not base.is_dir():
        raise ValueError(f"runs(path={str(path)!r}): it is a file; give the folder that holds run directories.")
    if any(os.path.lexists(base / name) for name in (runlog.SPEC, runlog.STATUS)):
        raise ValueError(f"runs(path={str(path)!r}): it is a run directory itself: see it with "
                         f"nbtrain.attach({str(path)!r}) (in a shell: nbtrain attach {path}), or list it with the "
                         f"others in its folder: runs({str(base.absolute().parent)!r}).")
    runlog.remove_stale_partials(base)
    for entry in sorted(os.scandir(base), key=lambda e: e.name):
        if not entry.name.startswith(runlog.PARTIAL):  # a run being submitted: not a run yet
            row = _row(Path(entry.path).absolute())
            if row is not None:
                table.append(row)
    return table


def _row(entry: Path) -> dict | None:
    """The table's row for `entry`; None for what is not a run at all."""
    if not any(os.path.lexists(entry / name) for name in (runlog.SPEC, runlog.STATUS)):
        return None
    row = {"run": entry.name, "function": "", "started": "", "devices": "", "status": "", "metrics": "",
           "reason": "", "dir": str(entry)}
    try:
        run = Run(entry)
        row.update(function=run.function,
                   started=datetime.fromtimestamp(run.spec["started"]).strftime("%Y-%m-%d %H:%M:%S"))
        status, summary = current_status(run.dir), run_summary(run.dir)
    except NotYours as error:
        return {**row, "status": "refused", "reason": str(error)}
    except (ValueError, OSError) as error:
        return {**row, "status": "damaged", "reason": str(error)}
    options = run.spec["launch"]
    # As the run planned them ("2 CPU ranks, gloo"); before it started, as they were asked for.
    devices = summary["devices"] or f"{options.get('devices')} ({options.get('accelerator')})"
    metrics = ", ".join(f"{name}={_shown(value)}" for name, value in summary["metrics"].items())
    return {**row, "devices": devices, "status": status["status"], "metrics": metrics,
            "reason": status.get("reason", "")}


def _shown(value) -> str:
    return f"{value:.4g}" if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
