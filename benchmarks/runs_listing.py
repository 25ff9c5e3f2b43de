"""`runs()` over many finished runs whose event logs are large: read from each run's summary.json
(what the supervisor's recorder writes now) against reading each run's logs (the only way before
summary.json, and still the way for a run the older code wrote). The same directories, in one
run, rounds interleaved; the logs are real files (1 MB each by default), in the page cache as
they are on a machine that just wrote them.

    python benchmarks/runs_listing.py [--runs 2000] [--log-mb 1] [--rounds 2]
"""
from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import nbtrain
from nbtrain.common import protocol, runlog
from nbtrain.notebook.detached.run_logs import summary_from_logs

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, record, table  # noqa: E402

LAUNCH = {"strategy": "ddp", "devices": 2, "accelerator": "cpu", "num_nodes": 1, "backend": None, "timeout": None,
          "launcher_options": None}


def rank_log(megabytes: float) -> bytes:
    """A rank's event log as a long run leaves it: progress, metrics and output lines."""
    lines, size, step = [protocol.header_line()], 0, 0
    while size < megabytes * 1e6:
        for event in (protocol.Progress(0, 0, "epoch", step, 100000, False, 12.5 + step, 0),
                      protocol.Metric(step, 0, "loss", 1.0 / (step + 1), False),
                      protocol.Output(0, "stdout", f"step {step}: loss {1.0 / (step + 1):.6f}")):
            line = protocol.event_line(0, event)
            lines.append(line)
            size += len(line)
        step += 1
    return b"".join(lines)


def make_runs(base: Path, count: int, megabytes: float) -> None:
    log = rank_log(megabytes)
    for n in range(count):
        where = base / f"20261125-120000-train-{n}"
        where.mkdir(mode=0o700)
        runlog.write_json(where / runlog.SPEC, {"function": "train", "started": time.time(), "max_restarts": 0,
                                                "launch": LAUNCH})
        runlog.write_json(where / runlog.STATUS, {"status": "finished", "restarts": [], "reason": "", "ended": 0})
        started = protocol.AttemptStarted("ddp on 2 CPU ranks, gloo", [0, 1], time.time())
        (where / runlog.EVENTS).write_bytes(protocol.header_line() + protocol.event_line(0, started))
        for rank in (0, 1):
            (where / runlog.rank_events(rank)).write_bytes(log)
        # What the recorder writes at the run's end: the same values runs() would read from the logs.
        runlog.write_json(where / runlog.SUMMARY, summary_from_logs(where))


def with_summaries(base: Path, on: bool) -> None:
    for where in base.iterdir():
        old, new = (where / "summary.off", where / runlog.SUMMARY) if on else (where / runlog.SUMMARY,
                                                                                  where / "summary.off")
        os.rename(old, new)


def timed(base: Path) -> tuple[float, list]:
    start = time.perf_counter()
    rows = nbtrain.runs(base)
    return time.perf_counter() - start, rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=2000)
    parser.add_argument("--log-mb", type=float, default=1.0)
    parser.add_argument("--rounds", type=int, default=2)
    options = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="nbtrain-bench-runs-"))
    times: dict[str, list[float]] = {"summary": [], "logs": []}
    try:
        make_runs(base, options.runs, options.log_mb)
        timed(base)  # once, not counted: the directories' metadata in the cache for both
        for _ in range(options.rounds):
            took, shown = timed(base)
            times["summary"].append(took)
            with_summaries(base, on=False)
            took, read = timed(base)
            times["logs"].append(took)
            with_summaries(base, on=True)
            assert [r["metrics"] for r in shown] == [r["metrics"] for r in read], "the two ways must list the same"
            assert len(shown) == options.runs and all(r["status"] == "finished" for r in shown)
    finally:
        shutil.rmtree(base)
    summary, logs = median(times["summary"]), median(times["logs"])
    per = options.runs
    rows = [["summary.json (now)", f"{summary:.3f}", f"{1000 * summary / per:.2f}", "1.0x",
             ", ".join(f"{t:.3f}" for t in times["summary"])],
            ["the event logs (before; a run the older code wrote)", f"{logs:.2f}", f"{1000 * logs / per:.2f}",
             f"{logs / summary:.0f}x", ", ".join(f"{t:.2f}" for t in times["logs"])]]
    record("Listing runs (runs_listing.py)", table(
        [f"runs() over {options.runs:,} finished runs, {options.log_mb:g} MB log per rank (2 ranks)", "median s",
         "ms per run", "vs summary", "rounds (s)"], rows)
        + "\n\nEach run also has run.json and status.json (read either way). The same directories in one run, "
          "rounds interleaved, the files in the page cache; both ways list the same rows. The issue measured 210 s "
          "for 2,000 runs with 1 MB logs before summary.json.")


if __name__ == "__main__":
    main()
