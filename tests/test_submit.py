"""submit / attach: runs that outlive the kernel, restarts from the last checkpoint, cancel."""
import functools
import glob
import io
import json
import os
import re
import signal
import subprocess
import tempfile
import threading
import time

import dill
import psutil
import pytest
import torch

import nbtrain
import nbtrain.notebook.detached.runs
import nbtrain.notebook.many.sweep
from conftest import Kernel
from nbtrain.common import protocol, runlog, session
from nbtrain.display.text import LineDisplay

KEEP_THE_TEMPLATE = True  # a local run's supervisor is a fork of it: one for the module (conftest.py)

# Defined in the kernel as a notebook would, and here for the plain launch it is compared with.
TRAIN = '''
import os, time, torch, nbtrain

def train(steps, pause=0.0, die_at=None, key_to=None):
    """DDP on a seeded model and seeded batches, resuming from ctx.run_dir's checkpoint if any.
    die_at: rank 1 exits (code 1) at that step, once per run directory. key_to: a file where
    rank 0 writes the channel's authkey (to look for it in the run directory)."""
    ctx = nbtrain.context()
    if key_to and ctx.rank == 0:
        open(key_to, "w").write(os.environ["NBTRAIN_AUTHKEY"])
    torch.manual_seed(0)
    model = ctx.setup(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    start = 0
    checkpoint = ctx.run_dir / "checkpoint" if ctx.run_dir else None
    if checkpoint is not None and checkpoint.exists():
        start = ctx.load_checkpoint(checkpoint, model=model, optimizer=opt, step=0)["step"]
    for step in ctx.progress(range(start, steps), initial=start):
        marker = ctx.run_dir / "died" if ctx.run_dir else None
        if step == die_at and ctx.rank == 1 and not marker.exists():
            marker.touch()
            os._exit(1)
        g = torch.Generator().manual_seed(100 * step + ctx.rank)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.log("loss", loss.item())
        print("step", step)
        if checkpoint is not None:
            ctx.save_checkpoint(checkpoint, model=model, optimizer=opt, step=step + 1)
        time.sleep(pause)
    return {k: v.detach().clone() for k, v in getattr(model, "module", model).state_dict().items()}
'''
exec(TRAIN)  # noqa: S102 - the same code as the kernel's


def _fails_once():
    marker = nbtrain.context().run_dir / "tried"
    if not marker.exists():
        marker.touch()
        raise ValueError("first try")
    return "second try"


class _Kept(LineDisplay):
    """The text display, keeping the state it drew."""

    def finish(self, state, ok):
        self.state = state
        super().finish(state, ok)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _wait_for(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _ended_cleanly(run) -> None:
    """Nothing of the run's session or tree is left, a little after it ended (a supervisor that
    was a SLURM job: the job has left the queue)."""
    who = json.loads((run.dir / runlog.SUPERVISOR).read_text())
    if "slurm_job" in who:
        _wait_for(lambda: not session.alive(who), 60, f"the supervisor's job {who['slurm_job']} to leave the queue")
        return
    pid = who["pid"]
    _wait_for(lambda: not session.members(pid), 20, f"the run's processes to exit: {session.members(pid)}")
    # The supervisor's kernel watcher is gone with its directory: removed by the supervisor, which
    # ends the watcher with its other descendants, or by the watcher, once a killed supervisor's
    # ranks have ended.
    watcher = os.path.join(tempfile.gettempdir(), f"nbtrain-watch-{pid}-*")
    _wait_for(lambda: not glob.glob(watcher), 10, f"{watcher} to be removed")


def _rank_pids(run) -> list[int]:
    return [e.pid for r in (0, 1) for _, e in runlog.Tail(run.dir / runlog.rank_events(r)).read()
            if isinstance(e, protocol.Hello)]


def test_a_directory_that_is_not_a_run_is_refused(tmp_path):
    with pytest.raises(ValueError, match="does not exist: give a directory made by nbtrain.submit"):
        nbtrain.attach(tmp_path / "nothing")
    with pytest.raises(ValueError, match=r"is not a run directory \(no run.json, status.json\)"):
        nbtrain.attach(tmp_path)
    assert nbtrain.runs(tmp_path) == []


def test_bad_submit_settings_are_refused_before_anything_starts(tmp_path):
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "file").touch()
    with pytest.raises(FileExistsError, match="exists and is not empty"):
        nbtrain.submit(train, 1, devices=2, accelerator="cpu", run_dir=tmp_path / "used")
    with pytest.raises(ValueError, match="max_restarts=-1: give a whole number"):
        nbtrain.submit(train, 1, devices=2, accelerator="cpu", run_dir=tmp_path / "new", max_restarts=-1)
    with pytest.raises(ValueError, match="strategy='nope' is not known"):
        nbtrain.submit(train, 1, strategy="nope", run_dir=tmp_path / "new")
    assert not (tmp_path / "new").exists()


def test_event_log_lines_are_whole_or_absent(tmp_path):
    from nbtrain.common.protocol import Metric, event_line

    log = runlog.EventLog(tmp_path / "e.jsonl")
    tail = runlog.Tail(tmp_path / "e.jsonl")
    log.write(0, Metric(1, 0, "loss", 0.5, False))
    line = event_line(0, Metric(2, 0, "loss", 0.25, False))
    with open(tmp_path / "e.jsonl", "ab") as file:
        file.write(line[:20])  # a writer killed mid-line
    assert tail.read() == [(0, Metric(1, 0, "loss", 0.5, False))]
    with open(tmp_path / "e.jsonl", "ab") as file:
        file.write(line[20:])
    assert tail.read() == [(0, Metric(2, 0, "loss", 0.25, False))]
    log.close()


@pytest.mark.slow
def test_a_run_outlives_a_killed_kernel_and_attach_gets_the_launch_values(tmp_path):
    kernel = Kernel()
    try:
        _, _, error, _ = kernel.run(f"{TRAIN}\nos.chdir({str(tmp_path)!r})\n"
                                    "nbtrain.warm_up(); run = nbtrain.submit(train, 12, 0.2, devices=2, accelerator='cpu')")
        assert error is None, error
        path = kernel.value("str(run.dir)")
        run = nbtrain.attach(path)
        _wait_for(lambda: "step 2" in run.logs(0), 60, "the run to take steps")
        # Its supervisor is a fork of the kernel's warm template, which dies with the kernel; it does not.
        supervisor = json.loads((run.dir / runlog.SUPERVISOR).read_text())["pid"]
        assert "nbtrain.rank.template_main" in psutil.Process(supervisor).cmdline()
        os.kill(kernel.manager.provisioner.process.pid, signal.SIGKILL)
        kernel.manager.provisioner.process.wait()
    finally:
        kernel.client.stop_channels()
        kernel.manager.cleanup_resources()
    assert run.status == "running"  # the kernel is gone, the run is not
    result = nbtrain.attach(path).result(timeout=120)
    assert run.status == "finished" and result.restarts == []
    assert os.stat(path).st_mode & 0o777 == 0o700
    assert [f"step {i}" for i in range(12)] == run.logs(1).split("\n")[:-1]
    plain = nbtrain.launch(train, 12, devices=2, accelerator="cpu", progress=False)
    assert _same(result.value, plain.value)
    assert result.metrics("loss") == plain.metrics("loss")
    _ended_cleanly(run)
    [row] = nbtrain.runs(tmp_path / "nbtrain-runs")
    assert (row["function"], row["status"], row["devices"]) == ("train", "finished", "2 CPU ranks, gloo")
    assert row["metrics"].startswith("loss=")


@pytest.mark.slow
def test_a_rank_that_dies_once_is_restarted_from_the_checkpoint(tmp_path, no_leftovers):
    run = nbtrain.submit(train, 6, die_at=3, devices=2, accelerator="cpu", run_dir=tmp_path / "run",
                         max_restarts=1)
    result = run.result(timeout=180)
    assert (tmp_path / "run" / "died").exists()  # it did die once
    [why] = result.restarts
    assert re.fullmatch(r"rank 1 failed: exited with code 1 \(PID \d+\)", why), why
    assert run.restarts == result.restarts and run.status == "finished"
    plain = nbtrain.launch(train, 6, devices=2, accelerator="cpu", progress=False)
    assert _same(result.value, plain.value)
    assert f"restarting (1 of 1) in 1 s: {why}" in (tmp_path / "run" / "events.jsonl").read_text()
    # Replayed from the logs, the resumed attempt's bar reads 3..6 and counts its 3 steps only.
    out = io.StringIO()
    display = _Kept(file=out, interval=3600)
    assert run.watch(progress=display) == "finished"
    for rank, view in display.state.ranks.items():
        assert f"rank {rank}  finished  epoch 6/6" in out.getvalue() and view.steps == 3
    _ended_cleanly(run)


@pytest.mark.slow
def test_result_is_woken_by_the_end_of_the_run(tmp_path, no_leftovers, monkeypatch):
    monkeypatch.setattr(nbtrain.notebook.detached.runs, "BACKSTOP", 3600.0)  # a result at all was woken by the run's end
    run = nbtrain.submit(train, 3, devices=2, accelerator="cpu", run_dir=tmp_path / "run")
    done = []
    waiter = threading.Thread(target=lambda: done.append(nbtrain.attach(run.dir).result()), daemon=True)
    waiter.start()  # an attached run, as another kernel would follow it
    waiter.join(600)
    assert done and len(done[0].metrics("loss")) == 3 and run.status == "finished"
    _ended_cleanly(run)


@pytest.mark.slow
def test_without_a_template_the_supervisor_is_a_fresh_interpreter(tmp_path, no_leftovers, monkeypatch):
    from nbtrain.placements import template_process

    monkeypatch.setattr(template_process, "_preload", template_process._preload)  # put back afterwards
    monkeypatch.setattr(template_process, "_failed", None)
    with pytest.raises(RuntimeError, match="no_such_module_for_nbtrain"):
        nbtrain.warm_up(preload=["no_such_module_for_nbtrain"])  # a template that cannot start
    run = nbtrain.submit(train, 1000, 0.1, devices=2, accelerator="cpu", run_dir=tmp_path / "run")
    _wait_for(lambda: "step 1" in run.logs(1), 60, "the run to take steps")
    supervisor = json.loads((run.dir / runlog.SUPERVISOR).read_text())["pid"]
    assert "nbtrain.notebook.detached.supervise" in " ".join(psutil.Process(supervisor).cmdline())
    run.cancel()
    assert run.status == "cancelled"
    _ended_cleanly(run)


@pytest.mark.slow
def test_the_first_submit_does_not_wait_for_the_template_it_starts(tmp_path, no_leftovers):
    """A kernel's first submit returns without waiting for the template to import torch: its
    supervisor is a fresh interpreter, and the template started in the background serves the next."""
    from nbtrain.placements import template_process

    nbtrain.stop_template()  # as in a kernel that never launched
    first = nbtrain.submit(train, 2, devices=2, accelerator="cpu", run_dir=tmp_path / "first")
    started = template_process.template(start=False)
    assert started is not None and started.pid is None  # started, not waited for
    supervisor = json.loads((first.dir / runlog.SUPERVISOR).read_text())["pid"]
    assert "nbtrain.notebook.detached.supervise" in " ".join(psutil.Process(supervisor).cmdline())
    assert len(first.result(timeout=300).metrics("loss")) == 2
    nbtrain.warm_up()  # ready now: the next supervisor is its fork
    second = nbtrain.submit(train, 2, devices=2, accelerator="cpu", run_dir=tmp_path / "second")
    supervisor = json.loads((second.dir / runlog.SUPERVISOR).read_text())["pid"]
    assert "nbtrain.notebook.detached.supervise" not in " ".join(psutil.Process(supervisor).cmdline())
    assert len(second.result(timeout=300).metrics("loss")) == 2
    _ended_cleanly(first)
    _ended_cleanly(second)


def _trial(lr):
    ctx = nbtrain.context()
    for step in range(3):
        ctx.log("loss", (lr - 0.01) ** 2 + 0.1 / (step + 1), step=step)


def test_a_submitted_sweep_refuses_what_does_not_apply_before_anything_starts(tmp_path):
    optuna = pytest.importorskip("optuna", reason="sweeps run on Optuna")
    space = {"lr": optuna.distributions.FloatDistribution(1e-3, 1e-1)}
    with pytest.raises(ValueError, match=r"^max_restarts= do not apply to a submitted sweep"):
        nbtrain.submit(nbtrain.sweep, _trial, space, trials=2, metric="loss", max_restarts=1, run_dir=tmp_path / "r")
    with pytest.raises(TypeError, match=r"give the trial function and its space, or an Optuna objective\(trial\) "):
        nbtrain.submit(nbtrain.sweep, trials=2, metric="loss", run_dir=tmp_path / "r")
    with pytest.raises(TypeError, match=r"give the trial function and its space"):
        nbtrain.submit(nbtrain.sweep, _trial, space, None, trials=2, metric="loss", run_dir=tmp_path / "r")
    with pytest.raises(ValueError, match=r"^metric=None"):
        nbtrain.submit(nbtrain.sweep, _trial, space, trials=2, run_dir=tmp_path / "r")
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_a_submitted_sweep_runs_in_the_supervisor_and_gives_the_sweep(tmp_path, no_leftovers):
    optuna = pytest.importorskip("optuna", reason="sweeps run on Optuna")
    space = {"lr": optuna.distributions.FloatDistribution(1e-3, 1e-1, log=True)}
    run = nbtrain.submit(nbtrain.sweep, _trial, space, trials=3, metric="loss", devices=2, accelerator="cpu",
                         run_dir=tmp_path / "sweep")
    assert run.function == "sweep of _trial"
    swept = run.result(timeout=300)
    assert isinstance(swept, nbtrain.notebook.many.sweep.Sweep) and run.status == "finished"
    values = [t.value for t in swept.study.trials]
    assert len(values) == 3 and swept.best_value == min(values)
    assert (tmp_path / "sweep" / "study.db").stat().st_mode & 0o077 == 0  # the study is the run directory's
    shown = repr(nbtrain.attach(tmp_path / "sweep"))  # its table, from the study, in any kernel
    assert shown.count("  complete  lr=") == 3 and "value=" in shown
    assert "3 trials here (3 complete)" in repr(swept)
    _ended_cleanly(run)


def _slow_trial(lr):
    ctx = nbtrain.context()
    for step in range(1000):
        ctx.log("loss", lr, step=step)
        time.sleep(0.1)


@pytest.mark.slow
def test_a_submitted_sweep_cancelled_stops_every_trial(tmp_path, no_leftovers):
    optuna = pytest.importorskip("optuna", reason="sweeps run on Optuna")
    space = {"lr": optuna.distributions.FloatDistribution(1e-3, 1e-1)}
    run = nbtrain.submit(nbtrain.sweep, _slow_trial, space, trials=4, metric="loss", devices=2, accelerator="cpu",
                         run_dir=tmp_path / "sweep")
    _wait_for(lambda: repr(run).count("  running  lr=") == 2, 120, "both slots to run a trial")
    run.cancel()
    assert run.status == "cancelled"
    _ended_cleanly(run)  # the trials' ranks and the supervisor's template with it
    assert repr(run).count("  running  ") == 0  # the study says how the trials ended, none still running


@pytest.mark.slow
def test_a_failure_beyond_the_restarts_is_the_launch_error(tmp_path, no_leftovers):
    run = nbtrain.submit(train, 6, die_at=1, devices=2, accelerator="cpu", run_dir=tmp_path / "run")
    with pytest.raises(nbtrain.WorkerError, match="rank 1 failed: exited with code 1") as caught:
        run.result(timeout=120)
    assert caught.value.rank == 1 and run.status == "failed"
    _ended_cleanly(run)


@pytest.mark.slow
def test_cancel_leaves_no_process(tmp_path, no_leftovers):
    run = nbtrain.submit(train, 1000, 0.1, devices=2, accelerator="cpu", run_dir=tmp_path / "run",
                         key_to=str(tmp_path / "key"))
    _wait_for(lambda: "step 1" in run.logs(1), 60, "the run to take steps")
    ranks = _rank_pids(run)
    assert len(ranks) == 2
    run.cancel()
    assert run.status == "cancelled"
    with pytest.raises(RuntimeError, match="was cancelled; it has no result"):
        run.result(timeout=5)
    _ended_cleanly(run)
    assert not any(session.alive(session.identity(p)) for p in ranks)
    key = (tmp_path / "key").read_text()
    files = [f for f in run.dir.rglob("*") if f.is_file()]
    assert len(key) >= 32 and not [f.name for f in files if key.encode() in f.read_bytes()]
    assert all(f.stat().st_mode & 0o077 == 0 for f in run.dir.iterdir() if f.is_file()), "nbtrain's files are private"


@pytest.mark.slow
def test_a_run_whose_supervisor_was_killed_is_failed_not_running(tmp_path, no_leftovers, monkeypatch):
    # No look at the run directory but what wakes it: result() hears of the supervisor's death itself.
    monkeypatch.setattr(nbtrain.notebook.detached.runs, "BACKSTOP", 3600.0)
    run = nbtrain.submit(train, 1000, 0.1, devices=2, accelerator="cpu", run_dir=tmp_path / "run")
    _wait_for(lambda: "step 1" in run.logs(1), 60, "the run to take steps")
    ranks = _rank_pids(run)
    killer = threading.Timer(0.5, os.kill, (json.loads((run.dir / runlog.SUPERVISOR).read_text())["pid"],
                                            signal.SIGKILL))
    killer.start()
    with pytest.raises(RuntimeError, match="ended without finishing it"):
        run.result(timeout=600)
    killer.join()
    assert run.status == "failed"
    assert "the run's supervisor (pid " in run.reason and "ended without finishing it" in run.reason
    _ended_cleanly(run)  # its ranks die with it
    assert not any(session.alive(session.identity(p)) for p in ranks)


@pytest.mark.slow
def test_a_one_device_run_in_the_supervisor_keeps_rank_0_output(tmp_path, no_leftovers):
    run = nbtrain.submit(train, 3, devices=1, accelerator="cpu", run_dir=tmp_path / "run")
    result = run.result(timeout=60)
    assert result.strategy == "single" and run.logs(0) == "step 0\nstep 1\nstep 2\n"
    assert len(result.metrics("loss")) == 3
    # The code's own exception, raised in the supervisor: restarted as a rank's failure would be.
    run = nbtrain.submit(_fails_once, devices=1, accelerator="cpu", run_dir=tmp_path / "again", max_restarts=1)
    assert run.result(timeout=60).value == "second try" and run.restarts == ["ValueError: first try"]


EXPORTED = '''
import time
import nbtrain

def work(n, fail=False, wait=0):
    ctx = nbtrain.context()
    print("rank", ctx.rank, "works", flush=True)
    time.sleep(wait)
    ctx.log("loss", 1.0 / (ctx.rank + 1))
    if fail and ctx.rank == 1:
        raise ValueError("rank 1 is broken")
    return n * (ctx.rank + 1)
'''

ATTACH = '''
import sys, nbtrain
for where in sys.argv[1:]:
    run = nbtrain.attach(where)
    try:
        print(run.status, run.result(timeout=5).values, repr(run.logs(1)))
    except nbtrain.WorkerError as error:
        print(run.status, "WorkerError", error.rank, str(error).splitlines()[0])
'''


@pytest.mark.slow
def test_an_exported_run_is_a_run_directory_that_attach_reads(tmp_path, no_leftovers):
    (tmp_path / "exported_work.py").write_text(EXPORTED)
    import sys
    sys.path.insert(0, str(tmp_path))
    try:
        import exported_work
        jobs = [nbtrain.export(exported_work.work, 21, fail=fail, wait=wait, to=tmp_path / name, devices=2,
                               accelerator="cpu") for name, fail, wait in (("good", False, 0), ("bad", True, 0),
                                                                           ("stopped", False, 120))]
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("exported_work", None)
    (tmp_path / "exported_work.py").unlink()  # job.py carries the function's source: the module is not needed
    env = {k: v for k, v in os.environ.items() if k != "NBTRAIN_RUN_DIR"}
    ran = [subprocess.run(["bash", str(job / "run.sh")], capture_output=True, text=True, timeout=120, env=env)
           for job in jobs[:2]]
    assert ran[0].returncode == 0 and "rank 0 returned: 21" in ran[0].stdout, ran[0].stderr[-2000:]
    assert "[rank 1] rank 1 works" in ran[0].stdout  # the terminal shows the run as launch does
    assert ran[1].returncode == 1 and "ValueError: rank 1 is broken" in ran[1].stderr, ran[1].stderr[-2000:]
    attached = subprocess.run([sys.executable, "-c", ATTACH, *(str(job / "run") for job in jobs[:2])],
                              capture_output=True, text=True, timeout=60).stdout.splitlines()  # as a later kernel
    assert attached[0] == "finished [21, 42] 'rank 1 works\\n'"
    said = r"was run by an exported job's run.sh.*the exported directory \(.*good\) is the job"
    with pytest.raises(ValueError, match=said):
        nbtrain.attach(jobs[0] / "run").export(tmp_path / "again")
    assert attached[1].startswith("failed WorkerError 1 "), attached[1]
    [good] = nbtrain.runs(jobs[0])
    assert (good["function"], good["status"], good["metrics"]) == ("work", "finished", "loss=1")
    assert dill.loads((jobs[0] / "run" / "value.pkl").read_bytes()) == 21

    # Ctrl-C in the terminal that runs run.sh: the run reads cancelled, saying so, and nothing is left.
    stopped = subprocess.Popen(["bash", str(jobs[2] / "run.sh")], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env=env, start_new_session=True)
    try:
        for line in stopped.stdout:
            if "rank 1 works" in line:
                break
        os.killpg(stopped.pid, signal.SIGINT)  # the terminal's Ctrl-C: its whole process group
        stopped.communicate(timeout=60)
    finally:
        if stopped.poll() is None:
            os.killpg(stopped.pid, signal.SIGKILL)
    run = nbtrain.attach(jobs[2] / "run")
    assert (run.status, run.reason) == ("cancelled", "interrupted (Ctrl-C)")


@pytest.mark.slow
def test_a_submitted_cell_and_attach_magic_in_a_kernel(kernel, tmp_path):
    # The module's kernel lives to the module's end: the tests that check for leftovers come before.
    assert kernel.run(f"import os; os.chdir({str(tmp_path)!r})\n%load_ext nbtrain\nscale = 10")[2] is None
    _, _, error, shown = kernel.run("%%nbtrain --submit --devices 2 --accelerator cpu\n"
                                    "import nbtrain\nctx = nbtrain.context()\nprint('rank', ctx.rank)\n"
                                    "scale * (ctx.rank + 1)")
    assert error is None, error
    assert any("nbtrain: ddp on 2 CPU ranks" in s.get("text/plain", "") for s in shown), shown  # the live view
    assert kernel.value("_nbtrain_run.result(timeout=120).values") == [10, 20]
    assert kernel.value("_nbtrain_run.logs(1)") == "rank 1\n"
    assert kernel.run("again = %nbtrain attach {_nbtrain_run.dir}")[2] is None
    assert kernel.value("(again.status, again.dir == _nbtrain_run.dir)") == ("finished", True)
    _, _, error, _ = kernel.run("%nbtrain attach nowhere")
    assert error["ename"] == "ValueError" and "'nowhere' does not exist" in error["evalue"]
    out, _, error, _ = kernel.run(f"%nbtrain export {tmp_path / 'job'}")
    assert error is None and "the last %%nbtrain cell is a job in" in out, (out, error)
    assert "print('rank', ctx.rank)\nscale * (ctx.rank + 1)" in (tmp_path / "job" / "job.py").read_text()
    ran = subprocess.run(["bash", str(tmp_path / "job" / "run.sh")], capture_output=True, text=True, timeout=120)
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert "rank 0 returned: 10" in ran.stdout and "rank 1" in ran.stdout, ran.stdout


@pytest.mark.slow
def test_an_export_runs_with_bash_and_gives_the_launch_weights(kernel, tmp_path):
    code = f"{TRAIN}\nimport torch.nn.functional as F\nSCALE = torch.ones(1)\n" \
           "def scaled(x):\n    return F.relu(x) * SCALE\n" \
           "def uses_helpers(steps):\n    return {k: scaled(v) for k, v in train(steps).items()}\n" \
           f"nbtrain.export(uses_helpers, 4, to={str(tmp_path / 'job')!r}, devices=2, accelerator='cpu')"
    assert kernel.run(code)[2] is None
    script = (tmp_path / "job" / "job.py").read_text()
    assert "def train(steps, pause=0.0, die_at=None, key_to=None):" in script and "def scaled(x):" in script
    assert "import torch.nn.functional as F" in script and "SCALE" not in script.split("def scaled")[0].split("dill")[0]
    scratch = tmp_path / "tmp"  # the job's TMPDIR: torchrun left a torchelastic_* directory in it per run
    scratch.mkdir()
    ran = subprocess.run(["bash", str(tmp_path / "job" / "run.sh")], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "TMPDIR": str(scratch)})
    assert ran.returncode == 0, ran.stderr[-2000:]
    assert not list(scratch.glob("torchelastic_*")), list(scratch.iterdir())
    assert "rank 0 returned: {'weight': tensor(" in ran.stdout
    value = dill.loads((tmp_path / "job" / "run" / "value.pkl").read_bytes())
    plain = nbtrain.launch(train, 4, devices=2, accelerator="cpu", progress=False)
    assert _same(value, {k: torch.relu(v) for k, v in plain.value.items()})
    with pytest.raises(ValueError, match="the source of 'train' cannot be read"):
        nbtrain.export(train, 4, to=tmp_path / "again")  # exec'd here: no source to write
    assert not (tmp_path / "again").exists()


@pytest.mark.slow
def test_a_slurm_run_outlives_the_kernel_and_attach_collects_it(slurm, tmp_path):
    kernel = Kernel()  # started after the fixture exported SLURM_CONF: it submits to the local cluster
    try:
        _, _, error, _ = kernel.run(f"{TRAIN}\nrun = nbtrain.submit(train, 8, 0.3, devices=2, accelerator='cpu', "
                                    f"cluster=nbtrain.Slurm(), run_dir={str(tmp_path / 'run')!r})")
        assert error is None, error
        run = nbtrain.attach(tmp_path / "run")
        # The supervisor is a batch job of its own: nothing of the run runs on this machine
        # outside SLURM, so the run outlives the notebook server's session, not just the kernel.
        who = json.loads((run.dir / runlog.SUPERVISOR).read_text())
        assert "slurm_job" in who and who["slurm_job"] in slurm.jobs(), (who, slurm.jobs())
        _wait_for(lambda: "step 1" in run.logs(1), 120, "the job's ranks to take steps")
        os.kill(kernel.manager.provisioner.process.pid, signal.SIGKILL)
        kernel.manager.provisioner.process.wait()
    finally:
        kernel.client.stop_channels()
        kernel.manager.cleanup_resources()
    result = run.result(timeout=180)
    assert result.devices.endswith("on SLURM") and run.status == "finished"
    plain = nbtrain.launch(train, 8, devices=2, accelerator="cpu", progress=False)
    assert _same(result.value, plain.value)
    _ended_cleanly(run)
    _wait_for(lambda: not slurm.jobs(), 30, "the job to leave the queue")


def test_bar_updates_are_logged_at_most_once_a_second_and_none_is_lost_at_the_end(tmp_path):
    from nbtrain.common.protocol import Metric, Progress
    from nbtrain.display.recorder import RunRecorder
    from nbtrain.notebook.run.runmodel import RunState

    recorder, state = RunRecorder(tmp_path, 0), RunState("ddp on 1 CPU rank", [0])
    recorder.start(state)
    for n in range(50):  # as a fast loop reports them: all within a second
        state.handle(Progress(0, 0, "epoch", n, 50, False))
    state.handle(Metric(3, 0, "loss", 0.5, False))
    state.handle(Progress(0, 0, "epoch", 50, 50, True))
    recorder.finish(state, True)
    recorder.close()
    logged = [(e.n, e.done) for _, e in runlog.Tail(tmp_path / runlog.rank_events(0)).read() if isinstance(e, Progress)]
    assert logged == [(0, False), (49, False), (50, True)]


@pytest.mark.slow
def test_an_export_runs_as_a_slurm_batch_job(slurm, tmp_path):
    # Written as a module file, so the source can be read (a notebook's cells work the same way).
    (tmp_path / "train_module.py").write_text(TRAIN)
    import sys
    sys.path.insert(0, str(tmp_path))
    try:
        import train_module
        job = nbtrain.export(train_module.train, 3, to=tmp_path / "job", devices=2, accelerator="cpu")
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("train_module", None)
    submitted = subprocess.run(["sbatch", "--parsable", str(job / "sbatch.sh")], cwd=tmp_path, capture_output=True,
                               text=True, check=True, env=slurm.env)
    job_id = submitted.stdout.strip().split(";")[0]
    _wait_for(lambda: job_id not in slurm.jobs(), 120, "the batch job to end")
    output = (job / "run" / f"slurm-{job_id}.out").read_text()
    assert "rank 0 returned: {'weight': tensor(" in output, output[-2000:]
    value = dill.loads((job / "run" / "value.pkl").read_bytes())
    assert _same(value, nbtrain.launch(train, 3, devices=2, accelerator="cpu", progress=False).value)


@pytest.mark.slow
def test_a_slurm_run_reads_queued_until_its_ranks_job_runs_and_cancel_leaves_no_job(slurm, tmp_path):
    # sbatch --hold: the ranks' job waits in the queue (JobHeldUser) until it is released.
    run = nbtrain.submit(functools.partial(time.sleep, 300), devices=2, accelerator="cpu",
                         cluster=nbtrain.Slurm(hold=True), run_dir=tmp_path / "run", progress=False)
    supervisor = json.loads((run.dir / runlog.SUPERVISOR).read_text())["slurm_job"]
    _wait_for(lambda: "JobHeldUser" in run.reason, 120, f"the ranks' job to be held: {run.reason!r}")
    [ranks] = [job for job in slurm.jobs() if job != supervisor]
    assert run.status == "queued"
    assert run.reason == f"waiting for the ranks to start: SLURM job {ranks} waits in the queue: PENDING (JobHeldUser)"
    time.sleep(2)  # still held, still queued: the supervisor's job runs, the ranks' does not
    assert run.status == "queued" and session.slurm_state(supervisor) == "RUNNING"
    subprocess.run(["scontrol", "release", ranks], env=slurm.env, check=True, capture_output=True)
    _wait_for(lambda: run.status != "queued", 60, "the ranks' job to start")
    assert run.status == "running" and run.reason == ""
    run.cancel()  # while its ranks run: both jobs go (a run that finishes: the kernel-killed test above)
    assert run.status == "cancelled"
    _wait_for(lambda: not slurm.jobs(), 60, f"both jobs to leave the queue: {slurm.jobs()}")

