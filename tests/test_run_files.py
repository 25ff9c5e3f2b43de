"""A submitted run's files on a shared machine: written whole or not at all (a full disk, a file-size
limit, a kernel killed mid-submit), read back only when they are yours and no link, damaged ones
named with their run, runs() from each run's summary, and bad input refused in one line."""
import json
import os
import pickle
import resource
import signal
import stat
import subprocess
import threading
import time
from pathlib import Path

import dill
import pytest

import nbtrain
from conftest import Kernel
from nbtrain.common import runlog, session
from nbtrain.common.errors import WorkerError
from nbtrain.common.private import IncompleteWrite, NotYours, write_private
from nbtrain.common.protocol import Metric, Note, Output
from nbtrain.display.recorder import RunRecorder
from nbtrain.notebook.run.runmodel import RunState

KEEP_THE_TEMPLATE = True  # a local run's supervisor is a fork of it: one for the module (conftest.py)

LAUNCH = {"strategy": "auto", "devices": 2, "accelerator": "cpu", "num_nodes": 1, "backend": None, "timeout": None,
          "launcher_options": None}


def _run_dir(where: Path, status="finished", summary=None, **more) -> Path:
    """A run directory as the supervisor leaves one (written here, with the same helpers)."""
    where.mkdir(mode=0o700, parents=True)
    runlog.write_json(where / runlog.SPEC, {"function": "train", "started": 1.7e9, "max_restarts": 0,
                                            "launch": LAUNCH})
    runlog.write_json(where / runlog.STATUS, {"status": status, "restarts": [], "reason": "", **more})
    if summary is not None:
        runlog.write_json(where / runlog.SUMMARY, summary)
    return where


def _within(seconds: float, call):
    """call()'s outcome (its value or exception), failing the test if it does not come back in time:
    a wait that never ends is the defect these tests look for."""
    outcome = {}

    def target():
        try:
            outcome["value"] = call()
        except BaseException as error:  # noqa: BLE001 - handed to the test
            outcome["error"] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    assert outcome, f"still waiting after {seconds} s"
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def _one_line(error: BaseException) -> str:
    text = str(error)
    assert "\n" not in text, text
    return text


# -- damaged and impossible files: an error naming the file and the run, at once ----------------

DAMAGED = {
    "cut": ('{"status": "runn', r"status.json' is damaged \(not JSON"),
    "bogus": ('{"status": "bogus"}', r"status.json' is damaged: its status 'bogus' is none of queued, running"),
    "not an object": ("[1, 2]", r"status.json' is damaged: it holds list \[1, 2\], not an object"),
    "no status": ('{"reason": ""}', r"status.json' is damaged: it has no 'status'"),
    "running, no supervisor": ('{"status": "running"}', r"status.json' says the run is running, but there is no "
                                                         r"supervisor.json"),
}


@pytest.mark.parametrize("case", DAMAGED)
def test_a_damaged_status_is_an_error_naming_the_file_and_the_run_at_once(tmp_path, case):
    text, says = DAMAGED[case]
    run = nbtrain.attach(_run_dir(tmp_path / "run"))
    (run.dir / runlog.STATUS).write_text(text)
    for call in (lambda: run.status, run.wait, run.result, lambda: run.watch(progress=False)):
        with pytest.raises(ValueError, match=says) as raised:
            _within(30, call)
        assert str(run.dir / runlog.STATUS) in str(raised.value)
    [row] = nbtrain.runs(tmp_path)
    assert row["status"] == "damaged" and row["function"] == "train" and str(run.dir) in row["reason"]


def test_damaged_run_files_are_named_never_raw(tmp_path):
    run = nbtrain.attach(_run_dir(tmp_path / "cut"))
    (run.dir / runlog.RESULT).write_bytes(pickle.dumps(list(range(1000)))[:-100])  # as the older code left one
    with pytest.raises(ValueError, match=r"result.pkl' cannot be read back \(UnpicklingError: pickle data was "
                                         r"truncated; [\d,]+ bytes\)") as raised:
        run.result(timeout=5)
    assert str(run.dir) in str(raised.value)
    run = nbtrain.attach(_run_dir(tmp_path / "gone"))
    with pytest.raises(ValueError, match=r"finished but has no result.pkl"):
        run.result(timeout=5)
    run = nbtrain.attach(_run_dir(tmp_path / "error", status="failed", reason="rank 1 failed"))
    (run.dir / runlog.ERROR).write_bytes(b"\x80\x04garbage")
    with pytest.raises(ValueError, match=r"error.pkl' cannot be read back"):
        run.result(timeout=5)
    (run.dir / runlog.ERROR).unlink()
    with pytest.raises(RuntimeError, match=f"the run in {run.dir} failed: rank 1 failed"):
        run.result(timeout=5)
    bad_spec = _run_dir(tmp_path / "spec")
    (bad_spec / runlog.SPEC).write_text('{"function": "train"}')
    with pytest.raises(ValueError, match=r"run.json' is damaged: it has no 'started', 'max_restarts', 'launch'"):
        nbtrain.attach(bad_spec)
    run = nbtrain.attach(_run_dir(tmp_path / "who", status="running"))
    (run.dir / runlog.SUPERVISOR).write_text('{"pid": "x"}')
    with pytest.raises(ValueError, match=r"supervisor.json' is damaged: it names no process"):
        run.status  # noqa: B018 (reading the property is what raises)


def test_runs_lists_every_run_and_a_damaged_one_with_its_reason(tmp_path):
    _run_dir(tmp_path / "1-good", summary={"devices": "2 CPU ranks, gloo", "ranks": [0, 1],
                                           "metrics": {"loss": 0.25, "('a', 1)": 2.0}})
    _run_dir(tmp_path / "2-cut")
    (tmp_path / "2-cut" / runlog.STATUS).write_text('{"status": "fin')
    _run_dir(tmp_path / "3-no-status")
    (tmp_path / "3-no-status" / runlog.STATUS).unlink()
    _run_dir(tmp_path / "4-bad-summary", summary={"devices": "x", "ranks": 3, "metrics": []})
    # Written by the older code: no summary.json; a metric named by a tuple, as ctx.log(('a', 1), 2.0) logs it.
    old = _run_dir(tmp_path / "5-old")
    (old / runlog.EVENTS).write_text(json.dumps([0, "start", None, "ddp on 2 CPU ranks, gloo", [0, 1], 1.7e9]) + "\n")
    (old / runlog.rank_events(0)).write_text("".join(json.dumps(e) + "\n" for e in (
        [0, "metric", 0, 0, "loss", 0.5, False], [0, "metric", 0, 0, ["a", 1], 2.0, False], [0, "junk"], "odd")))
    (tmp_path / "6-not-a-run").mkdir()
    (tmp_path / "notes.txt").write_text("mine")
    table = nbtrain.runs(tmp_path)
    rows = {r["run"]: r for r in table}
    assert list(rows) == ["1-good", "2-cut", "3-no-status", "4-bad-summary", "5-old"]
    assert rows["1-good"]["metrics"] == "loss=0.25, ('a', 1)=2" and rows["1-good"]["status"] == "finished"
    assert rows["5-old"]["metrics"] == "loss=0.5, ('a', 1)=2" and rows["5-old"]["devices"] == "2 CPU ranks, gloo"
    assert rows["2-cut"]["status"] == "damaged" and "status.json' is damaged (not JSON" in rows["2-cut"]["reason"]
    assert rows["3-no-status"]["status"] == "damaged" and "(no status.json)" in rows["3-no-status"]["reason"]
    assert "summary.json' is damaged" in rows["4-bad-summary"]["reason"]
    shown = repr(table)
    assert shown.splitlines()[0].split() == ["run", "function", "started", "devices", "status", "metrics", "reason"]
    assert "<td style='text-align:left'>damaged</td>" in table._repr_html_()


def test_runs_reads_a_runs_summary_not_its_logs(tmp_path):
    run = _run_dir(tmp_path / "run", summary={"devices": "2 CPU ranks, gloo", "ranks": [0, 1],
                                              "metrics": {"loss": 0.5}})
    (run / runlog.rank_events(0)).write_text(json.dumps([0, "metric", 0, 9, "loss", 9.0, False]) + "\n")
    assert nbtrain.runs(tmp_path)[0]["metrics"] == "loss=0.5"
    (run / runlog.SUMMARY).unlink()  # a run of the older code: its logs, read once
    assert nbtrain.runs(tmp_path)[0]["metrics"] == "loss=9"


# -- run directories an older nbtrain wrote ---------------------------------------------------------

V1_RUNS = Path(__file__).parent / "data" / "v1_runs"  # written by nbtrain before its logs had a version


def _old_run(tmp_path: Path, name: str) -> Path:
    """A copy of an unversioned run directory (2 CPU ranks, 2 epochs of 3 batches), ours and private."""
    where = tmp_path / name
    where.mkdir(mode=0o700)
    for file in (V1_RUNS / name).iterdir():
        write_private(where / file.name, file.read_bytes())
    return where


class _Kept:
    """A display that keeps the state it was given and what it was told."""

    def __init__(self):
        self.lines, self.state, self.ok = [], None, None

    def start(self, state):
        self.state = state

    def note(self, text):
        self.lines.append(text)

    def output(self, rank, stream, text):
        self.lines.append(f"[rank {rank}] {text}")

    def update(self, state):
        pass

    def finish(self, state, ok):
        self.ok = ok


def test_a_run_an_older_nbtrain_wrote_still_lists_replays_and_reads_back(tmp_path):
    finished, failed = _old_run(tmp_path, "finished"), _old_run(tmp_path, "failed")
    rows = {r["run"]: r for r in nbtrain.runs(tmp_path)}
    assert (rows["finished"]["status"], rows["failed"]["status"]) == ("finished", "failed")
    assert rows["finished"]["devices"] == "2 CPU ranks, gloo" and rows["finished"]["metrics"].startswith("loss=0.1667")
    result = nbtrain.attach(finished).result()  # its pickle names the classes where they were then
    assert result.values == [{"rank": 0}, {"rank": 1}]
    assert result.metrics("loss", rank=1) == pytest.approx([1 / n for n in range(1, 7)])
    assert result.history[0].step == 0 and result.history[0].name == "loss" and {v.rank for v in result.vitals} == {0, 1}
    with pytest.raises(WorkerError, match="rank 1 cannot go on") as raised:
        nbtrain.attach(failed).result()
    assert raised.value.rank == 1
    assert nbtrain.attach(failed).logs(1) == "rank 1 epoch 0 done\nrank 1 epoch 1 done\n"
    for run, ok in ((finished, True), (failed, False)):
        display = _Kept()
        nbtrain.attach(run).watch(progress=display)
        state = display.state
        assert display.ok is ok and state.title == "ddp on 2 CPU ranks, gloo" and "[rank 0] rank 0 epoch 1 done" in display.lines
        assert [(b.desc, b.n, b.total, b.done) for _, b in sorted(state.ranks[0].bars.items())] == \
            [("epoch", 2, 2, True), ("batch", 3, 3, True)]
        assert [m.value for m in state.history if m.rank == 0] == pytest.approx([1 / n for n in range(1, 7)])
        assert state.ranks[0].status == "finished" and state.ranks[0].ended_where == "returned from train()"
        assert state.ranks[0].pid is not None and state.vitals and state.ranks[0].steps == 6
    assert state.ranks[1].status == "failed" and state.ranks[1].detail == "ValueError: rank 1 cannot go on"
    assert [f.rank for f in state.failures] == [1] and "line 10, in train" in state.failures[0].traceback


# -- links, partial directories ------------------------------------------------------------------

def test_a_run_reached_through_a_link_is_refused_before_anything_is_read(tmp_path):
    real = _run_dir(tmp_path / "real" / "run")
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "linked").symlink_to(real)
    with pytest.raises(NotYours, match="is a symbolic link"):
        nbtrain.attach(tmp_path / "runs" / "linked")
    [row] = nbtrain.runs(tmp_path / "runs")
    assert row["status"] == "refused" and "symbolic link" in row["reason"] and row["function"] == ""
    (tmp_path / "base").symlink_to(tmp_path / "real")
    with pytest.raises(NotYours, match="folder .*base' is a symbolic link"):
        nbtrain.runs(tmp_path / "base")
    (real / runlog.RESULT).symlink_to(tmp_path / "elsewhere.pkl")
    (tmp_path / "elsewhere.pkl").write_bytes(dill.dumps("not yours to read"))
    with pytest.raises(NotYours, match="result.pkl' is a symbolic link"):
        nbtrain.attach(real).result(timeout=5)


def train_nothing():
    return None


def test_submit_or_export_into_a_link_is_refused_and_writes_nothing(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    os.chmod(target, 0o755)
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(NotYours, match="run_dir '.*link' is a symbolic link"):
        nbtrain.submit(train_nothing, devices=1, accelerator="cpu", run_dir=tmp_path / "link")
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755 and not os.listdir(target)
    assert sorted(os.listdir(tmp_path)) == ["link", "target"]  # no partial directory either
    with pytest.raises(NotYours, match="to '.*link' is a symbolic link"):
        nbtrain.export(train_nothing, to=tmp_path / "link", devices=1, accelerator="cpu")
    assert stat.S_IMODE(os.stat(target).st_mode) == 0o755 and not os.listdir(target)


def test_a_process_is_named_as_run_directories_always_named_it():
    # pid and proc(5)'s starttime (clock ticks since boot): what earlier versions wrote stays readable
    with open("/proc/self/stat") as f:
        starttime = f.read().rsplit(")", 1)[1].split()[19]
    me = session.identity(os.getpid())
    assert me == {"pid": os.getpid(), "start": starttime}
    assert session.alive(me)
    assert not session.alive({**me, "start": str(int(starttime) - 1)})  # its pid, another process
    assert session.identity(2**22 + 1) == {"pid": 2**22 + 1, "start": None}  # above any pid_max
    assert not session.alive(None)  # a damaged submitter in status.json: nothing alive, no TypeError


def test_what_an_interrupted_submit_left_is_removed_once_its_writer_is_gone(tmp_path):
    me = session.identity(os.getpid())
    stale = tmp_path / f"{runlog.PARTIAL}{me['pid']}-1-train"  # this pid, another start: a writer that is gone
    live = tmp_path / f"{runlog.PARTIAL}{me['pid']}-{me['start']}-other"  # being written by this process
    for partial in (stale, live):
        partial.mkdir(mode=0o700)
        (partial / runlog.JOB).write_bytes(b"\x80\x04half a jo")
    _run_dir(tmp_path / "done")
    assert [r["run"] for r in nbtrain.runs(tmp_path)] == ["done"]
    assert not stale.exists() and live.exists()
    stale.mkdir(mode=0o700)
    with pytest.raises(ValueError, match=r"'.*train' does not exist \(its submit was interrupted; the partial "
                                         r"directory it left was removed\)"):
        nbtrain.attach(tmp_path / "train")
    assert not stale.exists()


# -- the event log is best effort --------------------------------------------------------------

class _FileSizeLimit:
    """RLIMIT_FSIZE for this process (Python ignores SIGXFSZ: a write past it fails with EFBIG)."""

    def __init__(self, size: int):
        self.size, self.saved = size, resource.getrlimit(resource.RLIMIT_FSIZE)

    def __enter__(self):
        resource.setrlimit(resource.RLIMIT_FSIZE, (self.size, self.saved[1]))

    def __exit__(self, *exc):
        resource.setrlimit(resource.RLIMIT_FSIZE, self.saved)


def test_an_event_line_the_disk_cuts_is_an_incomplete_write(tmp_path):
    log = runlog.EventLog(tmp_path / "e.jsonl")
    log.write(0, Note("fits"))
    try:
        with _FileSizeLimit(os.path.getsize(tmp_path / "e.jsonl") + 10), pytest.raises(IncompleteWrite) as cut:
            log.write(0, Note("does not fit in ten bytes"))
    finally:
        log.close()
    assert str(cut.value).startswith("e.jsonl: file too large (wrote 10 of ")
    assert runlog.Tail(tmp_path / "e.jsonl").read() == [(0, Note("fits"))]


def test_a_log_write_that_fails_stops_the_logs_says_so_once_and_never_raises(tmp_path):
    said = []
    recorder, state = RunRecorder(tmp_path, 0, stopped=said.append), RunState("ddp on 2 CPU ranks, gloo", [0, 1])
    recorder.start(state)
    state.handle(Metric(0, 0, "loss", 1.0, False))
    with _FileSizeLimit(os.path.getsize(tmp_path / runlog.rank_events(0)) + 300):
        for step in range(1, 200):
            for rank in (0, 1):
                state.handle(Metric(step, rank, "loss", 1.0 / step, False))
                recorder.output(rank, "stdout", f"step {step}")
        recorder.finish(state, True)
        recorder.close()
    [reason] = said
    assert reason.startswith("rank-0.jsonl: file too large (wrote ") or reason.startswith("rank-1.jsonl"), reason
    assert state.ranks[0].metrics["loss"].value == 1.0 / 199  # the run's own state went on
    logged = [event for _, event in runlog.Tail(tmp_path / runlog.rank_events(0)).read()]
    assert logged and all(isinstance(e, (Metric, Output)) for e in logged)  # whole events, the cut line skipped
    summary = json.loads((tmp_path / runlog.SUMMARY).read_text())
    assert summary["ranks"] == [0, 1] and summary["devices"] == "2 CPU ranks, gloo"


# -- bad input: one line, naming the argument and what is accepted -------------------------------

def test_bad_input_is_refused_in_one_line(tmp_path):
    run = nbtrain.attach(_run_dir(tmp_path / "run", summary={"devices": "2 CPU ranks, gloo", "ranks": [0, 1],
                                                             "metrics": {}}))
    refused = [
        (lambda: nbtrain.attach(42), TypeError, "run_dir=42: give the path of a run directory"),
        (lambda: nbtrain.runs(42), TypeError, "runs(path=42): give the folder that holds run directories"),
        (lambda: run.logs(rank=99), ValueError, "logs(rank=99): the run has ranks 0, 1."),
        (lambda: run.logs(rank="0"), ValueError, "logs(rank='0'): give a rank number"),
        (lambda: run.result(timeout="1"), ValueError, "result(timeout='1'): give the seconds to wait"),
        (lambda: run.wait(timeout=-1), ValueError, "wait(timeout=-1): give the seconds to wait (a number, 0 or more)"),
        (lambda: run.wait(timeout=float("nan")), ValueError, "wait(timeout=nan)"),
        (lambda: nbtrain.export(train_nothing, to=42), TypeError, "export(to=42): give the path of a new or empty"),
        (lambda: nbtrain.export(train_nothing, to=tmp_path / "a\nb"), ValueError, "cannot hold '\\n'"),
        (lambda: nbtrain.export(train_nothing, to=tmp_path / "a b"), ValueError, "cannot hold ' '"),
        (lambda: nbtrain.export(lambda: 1, to=tmp_path / "job", devices=1, accelerator="cpu"), ValueError,
         "export(fn=<lambda>): a lambda has no name"),
        (lambda: nbtrain.export(_closure(), to=tmp_path / "job", devices=1, accelerator="cpu"), ValueError,
         "it reads n from the function it was defined in (a closure)"),
        (lambda: nbtrain.export(_decorated, to=tmp_path / "job", devices=1, accelerator="cpu"), ValueError,
         "its source is not one plain `def _decorated(...)`"),
    ]
    for call, kind, says in refused:
        with pytest.raises(kind) as raised:
            call()
        assert says in _one_line(raised.value), (says, raised.value)
    assert run.logs(1) == "" and not (tmp_path / "job").exists() and not list(tmp_path.glob("a*"))


def _closure():
    n = 1

    def inner():
        return n
    return inner


def _decorate(fn):
    return fn


@_decorate
def _decorated():
    return 1


def test_a_path_written_into_the_scripts_is_quoted(tmp_path, monkeypatch):
    import re
    import shlex
    import sys

    odd = str(tmp_path / "it's $(touch pwned)\nrm -rf ~")  # a directory on the kernel's import path
    monkeypatch.setattr(sys, "path", [odd, *sys.path])
    job = nbtrain.export(train_nothing, to=tmp_path / "job", devices=2, accelerator="cpu")
    for script in ("run.sh", "sbatch.sh"):
        text = (job / script).read_text()
        [quoted] = re.findall(r'^export PYTHONPATH=(.*?)"\$\{PYTHONPATH', text, re.MULTILINE | re.DOTALL)
        assert shlex.split(quoted)[0].split(os.pathsep)[0] == odd  # one word, as it was: nothing runs
        assert "\nrm -rf ~" not in text.replace(shlex.quote(shlex.split(quoted)[0]), "")


# -- with real supervisors, kernels, file systems and a second account ---------------------------

def _tmpfs(path: Path, size: str) -> Path:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs (a real full disk) needs root")
    path.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True)
    return path


@pytest.fixture
def small_disk(tmp_path):
    disk = _tmpfs(tmp_path / "disk", "1m")
    yield disk
    subprocess.run(["umount", "--lazy", str(disk)], check=True)


def large_result(size):
    return b"x" * size


@pytest.mark.slow
def test_a_result_the_disk_cannot_hold_fails_the_run_in_words(small_disk, no_leftovers):
    run = nbtrain.submit(large_result, 2_000_000, devices=1, accelerator="cpu", run_dir=small_disk / "run",
                         progress=False)
    with pytest.raises(RuntimeError) as raised:
        run.result(timeout=120)
    assert run.status == "failed"
    assert "result.pkl: no space left on device (wrote " in run.reason and " of 2,000," in run.reason, run.reason
    assert f"the run in {run.dir} failed: result.pkl: no space left on device" in _one_line(raised.value)
    assert not (run.dir / runlog.RESULT).exists()
    assert not [f for f in os.listdir(run.dir) if f.endswith(".tmp")]  # nothing half-written left


def fills_the_disk_then_frees_it(steps):
    """Rank 0 fills the run's disk, every rank logs and prints through the full disk, then rank 0
    frees it: the run must end as it would have, its logs stopped, not the training."""
    import time as clock

    ctx = nbtrain.context()
    filler = ctx.run_dir / "filler"
    if ctx.rank == 0:
        _fill(filler)
    ctx.barrier()
    for step in ctx.progress(range(steps)):
        ctx.log("loss", 1.0 / (step + 1))
        print("step", step, "x" * 200)
        clock.sleep(0.01)
    ctx.barrier()
    if ctx.rank == 0:
        filler.unlink()
    ctx.barrier()
    return ctx.rank


@pytest.mark.slow
def test_a_full_disk_stops_the_event_log_not_the_training(small_disk, no_leftovers):
    import io

    from nbtrain.display.text import LineDisplay

    run = nbtrain.submit(fills_the_disk_then_frees_it, 300, devices=2, accelerator="cpu", run_dir=small_disk / "run",
                         progress=False)
    assert run.result(timeout=180).values == [0, 1]
    assert run.status == "finished"
    status = json.loads((run.dir / runlog.STATUS).read_text())
    assert "no space left on device" in status["events_stopped"], status
    assert "event logging stopped" in (run.dir / runlog.SUPERVISOR_LOG).read_text()
    out = io.StringIO()
    assert run.watch(progress=LineDisplay(file=out, interval=3600)) == "finished"
    assert out.getvalue().count("the run's event logging stopped (") == 1, out.getvalue()


def fills_the_disk_in_the_supervisor():
    """Run in the supervisor itself (one device): a line in supervisor.log, then a full disk."""
    import sys

    print("the disk fills now", file=sys.stderr, flush=True)
    _fill(nbtrain.context().run_dir / "filler")
    return 1


def _fill(path: Path) -> None:
    """Write to `path` until the disk is full (raw writes: nothing buffered to fail later)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        while True:
            os.write(fd, b"x" * 65536)
    except OSError:
        pass
    finally:
        os.close(fd)


@pytest.mark.slow
def test_a_status_the_disk_cannot_hold_ends_the_supervisor_saying_so(small_disk, no_leftovers):
    run = nbtrain.submit(fills_the_disk_in_the_supervisor, devices=1, accelerator="cpu", run_dir=small_disk / "run",
                         progress=False)
    who = json.loads((run.dir / runlog.SUPERVISOR).read_text())
    with pytest.raises(RuntimeError) as raised:
        run.result(timeout=120)
    assert not session.alive(who) and run.status == "failed"
    log = (run.dir / runlog.SUPERVISOR_LOG).read_text()
    assert "nbtrain: the run's status cannot be written (status.json: no space left on device (wrote 0 of " in log
    assert f"the run's supervisor (pid {who['pid']}) ended without finishing it: the run's status cannot be written " \
           "(status.json: no space left on device" in run.reason, run.reason
    assert "ended without finishing it" in str(raised.value)


TAKES_LONG = '''
import time, nbtrain

def takes_long(blob, seconds):
    time.sleep(seconds)
    return len(blob)
'''


@pytest.mark.slow
def test_a_kernel_killed_during_submit_leaves_no_partial_run(tmp_path):
    kernel = Kernel()
    try:
        assert kernel.run(f"{TAKES_LONG}\nimport os; os.chdir({str(tmp_path)!r})\nblob = b'x' * 800_000_000")[2] is None
        kernel.client.execute("run = nbtrain.submit(takes_long, blob, 1, devices=1, accelerator='cpu')")
        runs = tmp_path / "nbtrain-runs"
        deadline = time.monotonic() + 120
        while not [f for f in runs.glob(f"{runlog.PARTIAL}*/.{runlog.JOB}.*.tmp") if _size(f) > 0]:
            assert time.monotonic() < deadline, "the job was never being written"
            time.sleep(0.005)
        os.kill(kernel.manager.provisioner.process.pid, signal.SIGKILL)  # half-way through job.pkl
        kernel.manager.provisioner.process.wait()
    finally:
        kernel.client.stop_channels()
        kernel.manager.cleanup_resources()
    [partial] = os.listdir(runs)
    assert partial.startswith(runlog.PARTIAL)  # all there is: no half-run under a run's name
    assert nbtrain.runs(runs) == [] and os.listdir(runs) == []  # its writer is gone: removed


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        return 0


# How a kernel can die while submit starts the supervisor the fresh-interpreter way (where no warm
# template can start): each replaces the kernel's subprocess.run (submit's only call of it starts the
# intermediate process) and kills the kernel with SIGKILL at that moment.
DIES = {
    # before anything is started: the run never starts, and reads so
    "before the supervisor starts": "def dying(*args, **kwargs):\n    os.kill(os.getpid(), signal.SIGKILL)\n",
    # while the intermediate process runs: it records the supervisor
    "while the supervisor is started": "def dying(args, **kwargs):\n"
                                       "    subprocess.Popen(args, env=kwargs['env'])\n"
                                       "    os.kill(os.getpid(), signal.SIGKILL)\n",
    # the supervisor started and nobody recorded it (a kernel's process group killed with the
    # intermediate, as a Jupyter restart does): it records itself
    "before anyone recorded the supervisor": "def dying(args, **kwargs):\n"
                                             "    log = open(args[3], 'ab')\n"
                                             "    subprocess.Popen(args[5:], env=kwargs['env'], start_new_session=True, "
                                             "stdout=log, stderr=log)\n"
                                             "    os.kill(os.getpid(), signal.SIGKILL)\n",
}


@pytest.mark.slow
@pytest.mark.parametrize("moment", DIES)
def test_a_kernel_killed_while_starting_the_supervisor_leaves_a_run_that_reads_true_and_cancels(tmp_path, moment):
    kernel = Kernel()
    try:
        setup = (f"{TAKES_LONG}\nimport os, signal, subprocess\n{DIES[moment]}subprocess.run = dying\n"
                 "import nbtrain.notebook.detached.submit as submitting\n"
                 "submitting._ready_template = lambda: None\n")  # no warm template in this test
        assert kernel.run(setup)[2] is None
        kernel.client.execute(f"nbtrain.submit(takes_long, b'', 600, devices=1, accelerator='cpu', "
                              f"run_dir={str(tmp_path / 'run')!r})")
        kernel.manager.provisioner.process.wait(timeout=60)
    finally:
        kernel.client.stop_channels()
        kernel.manager.cleanup_resources()
    run = nbtrain.attach(tmp_path / "run")
    if moment == "before the supervisor starts":
        assert run.status == "failed" and "the run never started: the kernel that submitted it (pid " in run.reason
        run.cancel()  # nothing to stop; it stays as it is
        assert run.status == "failed"
        assert [r["status"] for r in nbtrain.runs(tmp_path)] == ["failed"]
        return
    deadline = time.monotonic() + 60
    while not (run.dir / runlog.SUPERVISOR).exists() or run.status == "queued":
        assert time.monotonic() < deadline, "the supervisor never recorded itself"
        time.sleep(0.1)
    who = json.loads((run.dir / runlog.SUPERVISOR).read_text())
    assert run.status == "running" and session.alive(who)
    run.cancel()
    assert run.status == "cancelled" and not session.alive(who)
    deadline = time.monotonic() + 20
    while session.members(who["pid"]):
        assert time.monotonic() < deadline, f"the run's processes are left: {session.members(who['pid'])}"
        time.sleep(0.1)


def logs_a_tuple(steps):
    ctx = nbtrain.context()
    for step in range(steps):
        ctx.log("loss", 1.0 / (step + 1))
        ctx.log(("a", 1), 2.0)
    return ctx.rank


@pytest.mark.slow
def test_runs_lists_a_run_from_its_summary_with_a_tuple_metric(tmp_path, no_leftovers):
    run = nbtrain.submit(logs_a_tuple, 4, devices=2, accelerator="cpu", run_dir=tmp_path / "run", progress=False)
    assert run.result(timeout=120).values == [0, 1]
    summary = json.loads((run.dir / runlog.SUMMARY).read_text())
    assert summary == {"devices": "2 CPU ranks, gloo", "ranks": [0, 1], "metrics": {"loss": 0.25, "('a', 1)": 2.0}}
    [row] = nbtrain.runs(tmp_path)
    assert (row["status"], row["devices"], row["metrics"]) == ("finished", "2 CPU ranks, gloo", "loss=0.25, ('a', 1)=2")
    (run.dir / runlog.SUMMARY).unlink()
    assert nbtrain.runs(tmp_path)[0]["metrics"] == row["metrics"]  # from the logs: the same
    with pytest.raises(ValueError, match=r"logs\(rank=2\): the run has ranks 0, 1"):
        run.logs(2)


# -- another account on the machine -------------------------------------------------------------

@pytest.fixture
def other_user():
    if os.geteuid() != 0:
        pytest.skip("creating a second local account needs root")
    import pwd

    name = f"nbtprobe{os.getpid()}"
    subprocess.run(["useradd", "--no-create-home", "--shell", "/usr/sbin/nologin", name], check=True,
                   capture_output=True)
    try:
        yield pwd.getpwnam(name)
    finally:
        subprocess.run(["userdel", name], check=True, capture_output=True)


class _Marker:
    """Unpickled, it creates a file: proof that a pickle was read."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


@pytest.mark.slow
def test_another_users_run_is_refused_and_never_unpickled(tmp_path, other_user):
    marker = tmp_path / "their code ran"
    theirs = _run_dir(tmp_path / "runs" / "theirs")
    write_private(theirs / runlog.RESULT, pickle.dumps(_Marker(str(marker))))
    for path in (theirs, *theirs.iterdir()):
        os.chown(path, other_user.pw_uid, other_user.pw_gid)
    with pytest.raises(NotYours, match=f"run directory .*theirs' belongs to user '{other_user.pw_name}'"):
        nbtrain.attach(theirs)
    [row] = nbtrain.runs(tmp_path / "runs")
    assert row["status"] == "refused" and other_user.pw_name in row["reason"]
    # One of their files in a run directory of ours: refused too, before it is unpickled.
    mine = _run_dir(tmp_path / "runs" / "mine")
    write_private(mine / runlog.RESULT, pickle.dumps(_Marker(str(marker))))
    os.chown(mine / runlog.RESULT, other_user.pw_uid, other_user.pw_gid)
    with pytest.raises(NotYours, match=f"result.pkl' belongs to user '{other_user.pw_name}'"):
        nbtrain.attach(mine).result(timeout=5)
    assert not marker.exists()
    # Their empty directory as a run_dir: refused, nothing written there, its mode as it was.
    empty = tmp_path / "their-empty"
    empty.mkdir(mode=0o777)
    os.chmod(empty, 0o777)
    os.chown(empty, other_user.pw_uid, other_user.pw_gid)
    with pytest.raises(NotYours, match="run_dir '.*their-empty' belongs to user"):
        nbtrain.submit(train_nothing, devices=1, accelerator="cpu", run_dir=empty)
    with pytest.raises(NotYours, match="to '.*their-empty' belongs to user"):
        nbtrain.export(train_nothing, to=empty, devices=1, accelerator="cpu")
    assert stat.S_IMODE(os.stat(empty).st_mode) == 0o777 and not os.listdir(empty)


@pytest.mark.slow
def test_another_user_cannot_read_a_submitted_runs_files(other_user, no_leftovers):
    import shutil
    import tempfile

    # Outside pytest's own 0700 directory: only the run's modes stand between them and its files.
    where = Path(tempfile.mkdtemp(prefix="nbtrain-probe-"))
    try:
        os.chmod(where, 0o755)
        run = nbtrain.submit(logs_a_tuple, 2, devices=1, accelerator="cpu", run_dir=where / "run", progress=False)
        run.result(timeout=120)
        for name in (runlog.STATUS, runlog.RESULT, runlog.SUMMARY, runlog.JOB):
            probe = subprocess.run(["runuser", "-u", other_user.pw_name, "--", "cat", str(run.dir / name)],
                                   capture_output=True, text=True)
            assert probe.returncode != 0 and "Permission denied" in probe.stderr, (name, probe)
        modes = {p.name: stat.S_IMODE(p.lstat().st_mode) for p in [run.dir, *run.dir.iterdir()]}
        assert modes.pop("run") == 0o700 and set(modes.values()) == {0o600}, modes
    finally:
        shutil.rmtree(where)
