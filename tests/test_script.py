"""start="torchrun": the job as a script under torchrun, from a plain process (real ranks, real gloo)."""
import importlib.util
import os
import signal
import socket
import stat
import sys
import threading
import time

import psutil
import pytest
import torch
import torch.nn.functional as F

import nbtrain
from conftest import timed_out_in_place
from nbtrain import WorkerError
from nbtrain.common.errors import UnpicklableError
from nbtrain.common.source import free_names
from nbtrain.notebook.ipython.cell import run_cell
from nbtrain.placements.base import free_port

slow = pytest.mark.slow
CPU2 = {"strategy": "ddp", "start": "torchrun", "devices": 2, "accelerator": "cpu", "progress": False, "timeout": 60}  # never a hang


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.layer(x)


def assert_gone(pids, within=5.0):
    deadline = time.monotonic() + within
    alive = list(pids)
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.05)
    assert not alive, f"ranks still running: {alive}"


def pids_in(text):
    return [int(line.rsplit(" ", 1)[1]) for line in text.splitlines() if " pid " in line]


def train_and_report(lr):
    ctx = nbtrain.context()
    torch.manual_seed(ctx.rank)  # different starting weights: DDP must bring them together
    model = ctx.setup(Net())
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in ctx.progress(range(3)):
        loss = F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,)))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.log("loss", loss, sync_dist=True)
    job_dir = os.path.dirname(os.path.abspath(sys.argv[0]))
    modes = {name: stat.S_IMODE(os.stat(os.path.join(job_dir, name)).st_mode) for name in os.listdir(job_dir)}
    modes["."] = stat.S_IMODE(os.stat(job_dir).st_mode)
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID",
            "NBTRAIN_STRATEGY", "NBTRAIN_BACKEND", "NBTRAIN_ACCELERATOR"]
    launcher = psutil.Process(os.getppid())
    return (model, {k: os.environ.get(k) for k in keys}, job_dir, modes, os.getpid(), launcher.cmdline(),
            os.getsid(launcher.pid) == launcher.pid)


def test_a_free_port_lies_where_no_outgoing_connection_is_given_one():
    # torchrun's store binds the port a moment after nbtrain chose it; the kernel's ephemeral range
    # is where it hands ports to other processes' connections in that moment (a CI run lost one so).
    from nbtrain.placements.base import ephemeral_start

    low = ephemeral_start()
    for port in {free_port() for _ in range(20)}:
        assert 10000 <= port < low, port
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_job_dir_removes_the_dirs_of_dead_kernels_only():
    # A kernel killed with kill -9 cannot remove its launch's directory; the next launch does.
    import shutil
    import tempfile

    from nbtrain.placements.script import job_dir

    with open("/proc/sys/kernel/pid_max") as f:
        dead = int(f.read())  # pids stay below pid_max: no process has this one
    orphan = tempfile.mkdtemp(prefix=f"nbtrain-{dead}-")
    os.mkfifo(os.path.join(orphan, "stdout-0"), 0o600)
    live = tempfile.mkdtemp(prefix=f"nbtrain-{os.getppid()}-")
    mine = None
    try:
        mine = job_dir()
        assert not os.path.exists(orphan)
        assert os.path.isdir(live) and os.path.isdir(mine)
        assert os.path.basename(mine).startswith(f"nbtrain-{os.getpid()}-")
        assert stat.S_IMODE(os.stat(mine).st_mode) == 0o700
    finally:
        for path in (orphan, live, mine):
            if path:
                shutil.rmtree(path, ignore_errors=True)


@slow
def test_results_metrics_environment_and_private_job_dir(no_leftovers):
    import subprocess
    import tempfile

    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tempfile.mkdtemp(prefix=f"nbtrain-{dead.pid}-")  # left by a kernel that was killed
    os.mkdir(os.path.join(orphan, "tmp"), 0o700)  # as a launch's own is: a launcher TMPDIR inside
    live = tempfile.mkdtemp(prefix=f"nbtrain-{os.getppid()}-")  # another kernel's, still running
    try:
        result = nbtrain.launch(train_and_report, 0.5, **CPU2)
        assert not os.path.exists(orphan)
        assert os.path.isdir(live)
    finally:
        os.rmdir(live)
    assert (result.strategy, result.start) == ("ddp", "torchrun") and len(result.values) == 2
    (m0, env0, dir0, modes, pid0, cmd, own_session), (m1, env1, dir1, _, pid1, _, _) = result.values
    assert isinstance(m0, Net) and torch.equal(m0.layer.weight, m1.layer.weight)  # DDP synchronised them
    losses = result.metrics("loss")
    assert len(losses) == 3 and losses == result.metrics("loss", rank=1)
    assert (env0["RANK"], env1["RANK"], env0["WORLD_SIZE"], env0["LOCAL_WORLD_SIZE"]) == ("0", "1", "2", "2")
    assert env0["TORCHELASTIC_RUN_ID"] is not None  # torchrun started them (Lightning & co. rely on it)
    assert env0["NBTRAIN_STRATEGY"] == "ddp" and env0["NBTRAIN_BACKEND"] == "gloo" and env0["NBTRAIN_ACCELERATOR"] == "cpu"
    assert env0["MASTER_PORT"] == env1["MASTER_PORT"] != "29500"
    assert cmd[:3] == [sys.executable, "-m", "torch.distributed.run"] and own_session
    assert dir0 == dir1 and modes.pop(".") == 0o700 and modes.pop("tmp") == 0o700  # the launcher's TMPDIR
    assert modes.pop("store") == 0o700  # the ranks' rendezvous
    assert set(modes.values()) == {0o600}
    assert {"job.pkl", "rank.py", "stdout-0", "stderr-1"} <= set(modes)
    assert not os.path.exists(dir0)  # removed with everything in it
    assert_gone([pid0, pid1])


class BadBatch(ValueError):
    """The user's own exception class, with a field: caught here by its class, the field kept."""

    def __init__(self, message, batch=None):  # pickle rebuilds it from its message, then sets .batch
        super().__init__(message)
        self.batch = batch


def talk_and_fail(rank_to_fail):
    ctx = nbtrain.context()
    print(f"hello from {ctx.rank} pid {os.getpid()}", flush=True)
    print(f"warning from {ctx.rank}", file=sys.stderr, flush=True)
    ctx.barrier()  # both have spoken before one fails: otherwise rank 0 may be stopped first
    if ctx.rank == rank_to_fail:
        raise BadBatch(f"bad batch on rank {ctx.rank}", batch=7)
    time.sleep(60)  # the surviving rank must be stopped, not waited for
    print(f"rank {ctx.rank} was waited for", flush=True)


@slow
def test_a_raising_rank_names_the_users_line_and_stops_the_others(capfd, no_leftovers):
    # Also the script ranks' case of test_hostile's "a rank's exception is caught by its own class".
    with pytest.raises(BadBatch) as info:
        nbtrain.launch(talk_and_fail, 1, **CPU2)
    error = info.value
    assert isinstance(error, WorkerError) and error.batch == 7 and type(error.__cause__) is BadBatch
    assert error.rank == 1 and "rank 1 failed: BadBatch: bad batch on rank 1" in str(error)
    assert 'raise BadBatch(f"bad batch on rank {ctx.rank}", batch=7)' in error.traceback
    assert "in talk_and_fail" in error.traceback
    assert "run_rank" not in error.traceback and "rank_main" not in error.traceback
    out, err = capfd.readouterr()
    assert "[rank 0] hello from 0" in out and "[rank 1] hello from 1" in out
    assert "[rank 1] warning from 1" in err
    assert "was waited for" not in out  # rank 0 was stopped in its sleep
    assert_gone(pids_in(out))


def crash():
    ctx = nbtrain.context()
    print(f"rank {ctx.rank} pid {os.getpid()}", flush=True)
    ctx.barrier()
    if ctx.rank == 1:
        os.kill(os.getpid(), signal.SIGSEGV)
    time.sleep(60)


@slow
def test_a_rank_killed_by_a_signal_is_named_with_its_last_words(capfd, no_leftovers):
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(crash, **CPU2)
    error = info.value
    assert error.rank == 1 and "Signal 11 (SIGSEGV) received by PID" in str(error)
    assert "then: rank 0: stopped by torchrun after rank 1 failed" in str(error)
    assert "Fatal Python error: Segmentation fault" in error.traceback  # faulthandler's, through the pipe
    out = capfd.readouterr().out
    assert_gone(pids_in(out))


def slow_data_loading():
    time.sleep(600)


def stuck_in_barrier():
    ctx = nbtrain.context()
    ctx.barrier()
    if ctx.rank == 0:
        ctx.barrier()  # rank 1 never comes
    else:
        slow_data_loading()


@slow
def test_timeout_shows_where_each_rank_is_stuck(no_leftovers):
    # torchrun and two fresh torch imports first: 10 s was too few on a loaded machine
    error, timeout = timed_out_in_place(lambda timeout: nbtrain.launch(stuck_in_barrier, **{**CPU2, "timeout": timeout}),
                                        "stuck_in_barrier", timeouts=(15, 30))
    assert f"timed out after {timeout} s; still running: ranks [0, 1]" in str(error)
    rank1, rank0 = error.traceback.split("--- rank 0 stack (waiting) ---")  # the rank waited for comes first
    assert error.rank == 1 and "barrier" in rank0 and "stuck_in_barrier" in rank0
    assert "slow_data_loading" in rank1


def world():
    ctx = nbtrain.context()
    gathered = ctx.all_gather(torch.tensor([float(ctx.rank)]))
    return ctx.rank, ctx.world_size, gathered.flatten().tolist(), os.environ["GROUP_RANK"]


@slow
def test_two_nodes_on_one_machine(capfd, no_leftovers):
    endpoint = f"127.0.0.1:{free_port()}"
    results, errors = {}, []

    def node(rank):
        try:
            results[rank] = nbtrain.launch(world, num_nodes=2, **CPU2,
                                           launcher_options={"node_rank": rank, "rdzv_endpoint": endpoint})
        except BaseException as exc:
            errors.append(exc)

    other = threading.Thread(target=node, args=(1,))
    other.start()
    node(0)
    other.join(60)
    assert not errors and not other.is_alive()
    assert results[0].values == [(0, 4, [0.0, 1.0, 2.0, 3.0], "0"), (1, 4, [0.0, 1.0, 2.0, 3.0], "0")]
    assert results[1].values == [(2, 4, [0.0, 1.0, 2.0, 3.0], "1"), (3, 4, [0.0, 1.0, 2.0, 3.0], "1")]
    out = capfd.readouterr().out
    assert f"on node 1, run: the same launch(..., strategy='ddp', start='torchrun', num_nodes=2, launcher_options={{'node_rank': 1, " \
           f"'rdzv_endpoint': '{endpoint}'}})" in out
    assert "--nnodes 2 --nproc-per-node 2 --node-rank 0 --rdzv-backend static" in out


def flaky():
    ctx = nbtrain.context()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    if ctx.rank == 1 and attempt == 0:
        raise RuntimeError("transient")
    ctx.barrier()
    return attempt


@slow
def test_max_restarts_lets_torchrun_retry(capfd, no_leftovers):
    # The launcher's settings alone say torchrun: start='auto' picks it, as strategy='ddp' did before start=.
    result = nbtrain.launch(flaky, **{**CPU2, "start": "auto"}, launcher_options={"max_restarts": 1})
    assert result.start == "torchrun"
    assert result.values == [1, 1]
    err = capfd.readouterr().err
    assert "[rank 1] RuntimeError: transient" in err and "failed in attempt 1 of 2" in err


def report_environment():
    return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), " ".join(psutil.Process(os.getppid()).cmdline())


@slow
@pytest.mark.skipif(importlib.util.find_spec("accelerate") is None, reason="accelerate is not installed")
def test_accelerate_launches_the_same_job(no_leftovers):
    # strategy='ddp_script', the earlier name of strategy='ddp', start='torchrun'
    result = nbtrain.launch(report_environment, **{**CPU2, "strategy": "ddp_script", "start": "auto"},
                            launcher_options={"launcher": "accelerate"})
    assert [v[:2] for v in result.values] == [(0, 2), (1, 2)]
    assert "accelerate.commands.launch" in result.values[0][2]


@pytest.mark.parametrize("launcher", ["accelerate", "deepspeed"])
def test_a_missing_launcher_package_is_named(launcher, monkeypatch):
    monkeypatch.setitem(sys.modules, launcher, None)  # absent to this process, installed or not
    how = {"strategy": "deepspeed"} if launcher == "deepspeed" else {"launcher_options": {"launcher": launcher}}
    with pytest.raises(ModuleNotFoundError) as info:
        nbtrain.launch(report_environment, **{**CPU2, **how})
    assert f"launcher='{launcher}' needs the '{launcher}' package" in str(info.value)
    assert f"pip install {launcher}" in str(info.value) and info.value.name == launcher


@pytest.mark.parametrize("options, words", [
    ({"launcher": "mpirun"}, "launcher='mpirun' is not known. Accepted: 'torchrun', 'accelerate', 'deepspeed'"),
    ({"node_rank": 1}, "node_rank=1: with num_nodes=1, give an int from 0 to 0"),
    ({"max_restarts": -1}, "max_restarts=-1: give an int >= 0"),
    ({"rdzv_endpoint": "nohost"}, "rdzv_endpoint='nohost': give HOST:PORT"),
    ({"nodes": 2}, "launcher_options: 'nodes' not known. Accepted: 'launcher', 'node_rank'"),
])
def test_bad_launcher_options(options, words):
    with pytest.raises(ValueError) as info:
        nbtrain.launch(report_environment, **CPU2, launcher_options=options)
    assert words in str(info.value)


def test_several_nodes_need_an_endpoint_and_torchrun():
    with pytest.raises(ValueError, match="num_nodes=2 needs rdzv_endpoint='HOST:PORT'"):
        nbtrain.launch(report_environment, **CPU2, num_nodes=2)
    with pytest.raises(ValueError, match=r"launcher_options=\{'node_rank': 0\} with strategy='ddp_fork' \(start='fork'\): "
                                         "they are torchrun's settings"):
        nbtrain.launch(report_environment, **{**CPU2, "strategy": "ddp_fork", "start": "auto"},
                       launcher_options={"node_rank": 0})
    with pytest.raises(ValueError, match="num_nodes=2 with start='template': several machines meet through torchrun"):
        nbtrain.launch(report_environment, **{**CPU2, "start": "template"}, num_nodes=2)


def test_an_unpicklable_job_is_refused_before_anything_starts(no_leftovers):
    stream = (i for i in range(3))

    def uses_stream():
        return next(stream)

    with pytest.raises(UnpicklableError) as info:
        nbtrain.launch(uses_stream, **CPU2)
    assert "<closure stream>: generator" in str(info.value)  # the path to it, from pack_job


# -- cell mode, without a kernel --------------------------------------------------------------

@pytest.mark.parametrize("source, expected", [
    ("x = y + 1\nprint(x)", ["y", "print"]),
    ("x = 1\nx = x + 1", []),
    ("lr = lr * 0.1", ["lr"]),
    ("total += 1", ["total"]),
    ("for model in models:\n    model.fit()", ["models"]),
    ("def f():\n    return helper(z)\nz = 2\nf()", ["helper"]),
    ("import numpy as np\nnp.zeros(1)", []),
    ("[i * k for i in items]", ["items", "k"]),
    ("{k: [v for v in vs if v > lo] for k, vs in table.items()}", ["table", "lo"]),
    ("class A(Base):\n    size = width\nA()", ["Base", "width"]),
    ("try:\n    pass\nexcept E as err:\n    print(err)", ["E", "print"]),
])
def test_free_names_are_the_names_read_before_the_cell_binds_them(source, expected):
    assert free_names(source) == expected


CELL = """\
offset = 100
ctx = nbtrain.context()
if ctx.rank == fail_on:
    raise KeyError("nope")
helper(ctx.rank) + m.sqrt(16)
"""


def _namespace(fail_on):
    ns = {"__name__": "__main__", "nbtrain": nbtrain, "m": __import__("math"), "fail_on": fail_on, "scale": 3}
    exec("def helper(v):\n    return v * scale + offset\n", ns)  # a function "from an earlier cell"
    return ns


@slow
def test_a_cell_runs_as_a_script_with_the_names_it_uses(no_leftovers):
    result = run_cell(CELL, _namespace(fail_on=-1), start="torchrun", devices=2, accelerator="cpu", progress=False, timeout=60)
    # `offset` is the cell's own: helper, defined earlier, sees it as it would in the kernel.
    assert result.values == [104.0, 107.0] and result.value == 104.0


@slow
def test_a_failing_cell_reports_its_own_line(no_leftovers):
    with pytest.raises(WorkerError) as info:
        run_cell(CELL, _namespace(fail_on=1), start="torchrun", devices=2, accelerator="cpu", progress=False, timeout=60)
    assert info.value.rank == 1
    assert info.value.traceback.splitlines()[1:3] == ['  File "<nbtrain cell>", line 4, in <module>',
                                                      '    raise KeyError("nope")']


class Loader:
    def __init__(self):
        self.batches = (i for i in range(3))


def test_a_cell_with_an_unpicklable_name_is_refused_before_anything_starts(no_leftovers):
    ns = {"loader": Loader()}
    with pytest.raises(UnpicklableError) as info:
        run_cell("next(loader.batches)", ns, start="torchrun", devices=2, accelerator="cpu", progress=False, timeout=60)
    assert "the names the cell uses from earlier cells (loader)" in str(info.value)
    assert "loader.batches: generator" in str(info.value)
