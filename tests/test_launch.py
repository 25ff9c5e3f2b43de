"""launch() from a plain process: real ranks, real gloo, real failures."""
import ctypes
import faulthandler
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import nbtrain
from nbtrain import WorkerError
from nbtrain.common.errors import UnpicklableError
from nbtrain.notebook.run import choices
from nbtrain.placements import template_process
from nbtrain.rank.context import rank_zero_only

pytestmark = pytest.mark.slow
STARTS = ["fork", "template"]  # start="spawn" and "torchrun": tests/test_hostile.py, tests/test_script.py


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x):
        return self.layer(x)


DATA = TensorDataset(torch.randn(64, 4), torch.randint(0, 2, (64,)))


def train(lr, epochs=2):
    ctx = nbtrain.context()
    torch.manual_seed(ctx.rank)  # different starting weights: DDP must bring them together
    model = ctx.setup(Net())
    loader = ctx.loader(DATA, batch_size=8, shuffle=True)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for _ in ctx.progress(range(epochs), desc="epoch"):
        for x, y in ctx.progress(loader, desc="batch"):
            loss = F.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            ctx.log("loss", loss, sync_dist=True)
    return model


@pytest.mark.parametrize("start", STARTS)
def test_trained_model_comes_back_from_every_rank(start, no_leftovers):
    result = nbtrain.launch(train, 0.5, devices=2, accelerator="cpu", start=start, progress=False)
    assert (result.strategy, result.start) == ("ddp", start)
    assert isinstance(result.value, Net) and not isinstance(result.value, torch.nn.parallel.DistributedDataParallel)
    assert len(result.values) == 2
    w0, w1 = (v.layer.weight for v in result.values)
    assert torch.equal(w0, w1)  # DDP synchronised the replicas
    assert result.effective_batch_size == 16
    losses = result.metrics("loss")
    assert len(losses) == 2 * 4 and losses == result.metrics("loss", rank=1)  # synced: same on both ranks
    assert {m.rank for m in result.history} == {0, 1}


def report_environment():
    ctx = nbtrain.context()
    keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"]
    return {k: os.environ[k] for k in keys}, (ctx.rank, ctx.world_size, ctx.is_global_zero, str(ctx.device))


@pytest.mark.parametrize("start", STARTS)
def test_ranks_get_torchrun_environment(start, no_leftovers):
    result = nbtrain.launch(report_environment, devices=2, accelerator="cpu", start=start, progress=False)
    (env0, ctx0), (env1, ctx1) = result.values
    assert (env0["RANK"], env1["RANK"]) == ("0", "1")
    assert env0["WORLD_SIZE"] == env1["WORLD_SIZE"] == "2" and env1["LOCAL_WORLD_SIZE"] == "2"
    assert env0["MASTER_ADDR"] == "127.0.0.1" and env0["MASTER_PORT"] == env1["MASTER_PORT"]
    assert ctx0 == (0, 2, True, "cpu") and ctx1 == (1, 2, False, "cpu")


def join_a_gloo_group_counting_barriers():
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    met, real = [], c10d.barrier
    c10d.barrier = lambda *args, **kwargs: (met.append(args or kwargs), real(*args, **kwargs))[1]
    setting_before = os.environ["TORCH_DIST_INIT_BARRIER"]
    dist.init_process_group("gloo")
    return len(met), setting_before, os.environ["TORCH_DIST_INIT_BARRIER"]


@pytest.mark.parametrize("users_setting, met", [(None, 1), ("0", 0)])
def test_a_gloo_group_is_set_up_only_once_every_rank_is_connected(users_setting, met, monkeypatch, no_leftovers):
    # A rank that returns right after its set-up tore its group down while a peer still connected
    # (test_libraries.py's Accelerator race). The ranks meet once over the gloo mesh just made: c10d's
    # barrier, not torch's store barrier (TORCH_DIST_INIT_BARRIER, ~4-10 ms polling the file store);
    # the variable still reads "1" in the ranks, and a user's own setting wins.
    if users_setting is not None:
        monkeypatch.setenv("TORCH_DIST_INIT_BARRIER", users_setting)
    result = nbtrain.launch(join_a_gloo_group_counting_barriers, devices=2, accelerator="cpu", start="fork",
                            progress=False)
    setting = users_setting or "1"
    assert result.values == [(met, setting, setting)] * 2


def test_a_forked_rank_is_waited_for_until_it_ends_and_not_after():
    # Forked ranks are plain os.fork children waited on through a pidfd. One that a kernel ignoring
    # SIGCHLD had reaped itself cannot be waited for: join returns at once instead of looking until
    # its deadline.
    from nbtrain.placements.processes import _fork, _forked

    exits = {}
    for name, end in (("code", lambda: os._exit(3)), ("signal", lambda: os.kill(os.getpid(), signal.SIGKILL))):
        process = _forked(_fork(end), [0])
        process.join(30.0)
        exits[name] = process.poll()
    assert exits == {"code": 3, "signal": -signal.SIGKILL}
    previous = signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    try:
        process = _forked(_fork(lambda: os._exit(0)), [0])
        began = time.monotonic()
        process.join(30.0)
        assert time.monotonic() - began < 20 and process.poll() is None
    finally:
        signal.signal(signal.SIGCHLD, previous)
        process.close()


def test_the_earlier_names_run_as_their_pair_and_are_said_once(capfd, monkeypatch, no_leftovers):
    monkeypatch.setattr(choices, "_said", set())  # as in a fresh kernel
    runs = [nbtrain.launch(report_environment, devices=2, accelerator="cpu", strategy="ddp_notebook", progress=False)
            for _ in range(2)]
    assert [(r.strategy, r.start) for r in runs] == [("ddp", "fork")] * 2
    out = capfd.readouterr().out
    assert out.count("nbtrain: strategy='ddp_notebook' is strategy='ddp', start='fork' (the earlier name still "
                     "works)\n") == 1 and out.count("nbtrain:") == 1


def test_each_launch_picks_its_own_port(no_leftovers):
    ports = {nbtrain.launch(report_environment, devices=2, accelerator="cpu", start="fork",
                            progress=False).value[0]["MASTER_PORT"] for _ in range(3)}
    assert len(ports) == 3


def helpers():
    ctx = nbtrain.context()
    gathered = ctx.all_gather(torch.tensor([ctx.rank * 10.0]))
    objects = ctx.all_gather({"rank": ctx.rank})
    mean = ctx.log("x", float(ctx.rank), sync_dist=True)
    own = ctx.log("y", float(ctx.rank))
    ctx.barrier()
    ctx.print("printed once")
    zero_only = rank_zero_only(lambda: "ran")()
    loader = ctx.loader(list(range(20)), batch_size=5, shuffle=True)
    epochs = [[int(i) for batch in loader for i in batch] for _ in range(2)]
    return gathered.tolist(), objects, mean, own, zero_only, epochs, len(loader)


def test_context_helpers_across_ranks(capfd, no_leftovers):
    result = nbtrain.launch(helpers, devices=2, accelerator="cpu", start="fork", progress=False)
    (g0, o0, mean0, own0, z0, ep0, n0), (g1, o1, mean1, own1, z1, ep1, n1) = result.values
    assert g0 == g1 == [[0.0], [10.0]]
    assert o0 == o1 == [{"rank": 0}, {"rank": 1}]
    assert mean0 == mean1 == 0.5 and (own0, own1) == (0.0, 1.0)
    assert (z0, z1) == ("ran", None)
    assert n0 == n1 == 2
    for epoch in range(2):
        assert sorted(ep0[epoch] + ep1[epoch]) == list(range(20))  # disjoint shards cover the data
    assert ep0[0] != ep0[1]  # set_epoch: a new shuffle each epoch
    out = capfd.readouterr().out
    assert out.count("printed once") == 1 and "[rank 0] printed once" in out


def talk_and_fail(rank_to_fail):
    ctx = nbtrain.context()
    print(f"hello from {ctx.rank}", flush=True)
    import sys
    print(f"warning from {ctx.rank}", file=sys.stderr, flush=True)
    ctx.barrier()  # both have spoken before one fails
    if ctx.rank == rank_to_fail:
        raise ValueError(f"bad batch on rank {ctx.rank}")
    time.sleep(60)  # the surviving rank must be stopped, not waited for
    print(f"rank {ctx.rank} was waited for", flush=True)


@pytest.mark.parametrize("start", STARTS)
def test_a_raising_rank_stops_the_others(start, capfd, no_leftovers):
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(talk_and_fail, 1, devices=2, accelerator="cpu", start=start, progress=False)
    error = info.value
    assert error.rank == 1
    assert "rank 1 failed: ValueError: bad batch on rank 1" in str(error)
    assert 'raise ValueError(f"bad batch on rank {ctx.rank}")' in error.traceback
    assert "in talk_and_fail" in error.traceback and "run_rank" not in error.traceback
    captured = capfd.readouterr()
    assert "[rank 0] hello from 0" in captured.out and "[rank 1] hello from 1" in captured.out
    assert "[rank 1] warning from 1" in captured.err
    assert "was waited for" not in captured.out  # rank 0 was stopped in its sleep


def test_worker_error_renders_the_workers_traceback():
    error = WorkerError(1, "ValueError: x", "Traceback...\n  File cell, line 3\nValueError: x", ("rank 0: killed",))
    lines = error._render_traceback_()
    assert lines[0] == "WorkerError: rank 1 failed: ValueError: x" and "then: rank 0: killed" in lines
    import pickle

    again = pickle.loads(pickle.dumps(error))
    assert (again.rank, again.traceback, again.others) == (1, error.traceback, error.others)


def crash(how):
    ctx = nbtrain.context()
    if ctx.rank == 0:
        print("about to die", flush=True)
        if how == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        os._exit(3)
    time.sleep(60)


@pytest.mark.parametrize("how, expected", [("segv", "Signal 11 (SIGSEGV) received by PID"),
                                           ("exit", "exited with code 3")])
def test_a_dying_rank_is_named_with_its_signal_or_code(how, expected, capfd, no_leftovers):
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(crash, how, devices=2, accelerator="cpu", start="fork", progress=False)
    assert info.value.rank == 0 and expected in str(info.value)
    if how == "segv":
        assert "Fatal Python error: Segmentation fault" in info.value.traceback  # faulthandler's last words
    out = capfd.readouterr()
    assert "[rank 0] about to die" in out.out  # output of a dying rank is not lost
    # faulthandler's whole report (every thread, the kernel's inherited frames, the extension
    # modules) stays out of the cell: the error shows the part that matters.
    assert "Fatal Python error" not in out.out + out.err and "Extension modules" not in out.out + out.err


def test_a_dying_rank_reports_even_when_the_kernel_lost_faulthandler_s_handlers(capfd, no_leftovers):
    # ray.init() replaces faulthandler's fatal-signal handlers in the notebook's process and
    # ray.shutdown() leaves SIG_DFL there, while faulthandler still counts itself enabled: a forked
    # rank's faulthandler.enable() then installed nothing, and the rank died without a word.
    libc = ctypes.CDLL(None, use_errno=True)
    enabled = faulthandler.is_enabled()
    if not enabled:  # as pytest's faulthandler plugin and a kernel have it
        faulthandler.enable(file=sys.__stderr__)
    saved = ctypes.create_string_buffer(256)  # this process's struct sigaction for SIGSEGV (152 bytes on Linux)
    assert libc.sigaction(signal.SIGSEGV, None, saved) == 0
    assert libc.sigaction(signal.SIGSEGV, ctypes.create_string_buffer(256), None) == 0  # zeros: SIG_DFL
    try:
        with pytest.raises(WorkerError) as info:
            nbtrain.launch(crash, "segv", devices=2, accelerator="cpu", start="fork", progress=False)
    finally:
        libc.sigaction(signal.SIGSEGV, saved, None)
        if not enabled:
            faulthandler.disable()
    assert info.value.rank == 0 and "Signal 11 (SIGSEGV) received by PID" in str(info.value)
    assert "Fatal Python error: Segmentation fault" in info.value.traceback


def slow_data_loading():
    time.sleep(600)


def stuck_in_barrier():
    ctx = nbtrain.context()
    ctx.barrier()
    if ctx.rank == 0:
        ctx.barrier()  # rank 1 never comes
    else:
        slow_data_loading()


@pytest.mark.parametrize("start", STARTS)
def test_timeout_shows_where_each_rank_is_stuck(start, no_leftovers):
    if start == "template":
        nbtrain.warm_up()  # the timeout counts from the launch: a cold template's torch import is not in it
    with pytest.raises(WorkerError) as info:
        # 5 s: forked ranks start in milliseconds, and both are at their place (a barrier, a sleep) long before
        nbtrain.launch(stuck_in_barrier, devices=2, accelerator="cpu", start=start, timeout=5, progress=False)
    message = str(info.value)
    assert info.value.rank == 1  # the rank the other waits for, not the one that waits (issue 38)
    assert "timed out after 5 s; still running: ranks [0, 1]" in message
    assert "rank 1 is not in a collective" in message and "The others wait for rank 1." in message
    rank1, rank0 = info.value.traceback.split("--- rank 0 stack (waiting) ---")
    assert "barrier" in rank0 and "stuck_in_barrier" in rank0
    assert "--- rank 1 stack ---" in rank1 and "slow_data_loading" in rank1


def one_rank_never_returns():
    if nbtrain.context().rank == 0:
        slow_data_loading()
    return "done"


def test_timeout_names_finished_ranks(no_leftovers):
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(one_rank_never_returns, devices=2, accelerator="cpu", start="fork", timeout=3,
                       progress=False)
    assert "timed out after 3 s; still running: ranks [0]; finished: ranks [1]" in str(info.value)
    assert "slow_data_loading" in info.value.traceback

def test_a_timeout_before_the_ranks_started_says_they_were_still_starting(no_leftovers):
    # Plain spawned ranks import torch first (seconds); a timeout of 0.2 s comes before either
    # reached the notebook, so none could send a stack: the report says why, not only "no answer".
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(one_rank_never_returns, devices=2, accelerator="cpu", start="spawn", timeout=0.2,
                       progress=False)
    assert "timed out after 0.2 s; still running: ranks [0, 1]" in str(info.value)
    assert info.value.traceback.count("(no stack: the rank was still starting: it had not reached the notebook yet)") \
        == 2, info.value.traceback



def stuck_in_native_code():
    if nbtrain.context().rank == 1:
        import ctypes

        libc = ctypes.CDLL(None)
        while True:
            libc.sleep(60)  # C code: Python's own stack cannot say more than the call (a signal ends one)
    return "done"


def test_a_rank_stuck_in_native_code_is_shown_with_its_native_stack(no_leftovers):
    import shutil

    with pytest.raises(WorkerError) as info:
        nbtrain.launch(stuck_in_native_code, devices=2, accelerator="cpu", start="fork", timeout=4,
                       progress=False)
    assert "timed out after 4 s; still running: ranks [1]; finished: ranks [0]" in str(info.value)
    shown = info.value.traceback
    if shutil.which("py-spy") is None:  # the test extra installs it; without it nbtrain says how to get it
        assert "`pip install py-spy` and nbtrain shows it here" in shown
        return
    native = shown.split("--- rank 1 native stack (py-spy) ---")[1]
    assert "sleep (libc" in native and "stuck_in_native_code" in native, native
    assert "a process group destroyed while a DDP model still used it" in native


def test_in_process_single_device(no_leftovers):
    def local():
        ctx = nbtrain.context()
        for _ in ctx.progress(range(3)):
            ctx.log("v", 1.0)
        return ctx.setup(Net()), ctx.world_size, ctx.strategy

    result = nbtrain.launch(local, devices=1, accelerator="cpu", progress=False)
    model, world, strategy = result.value
    assert isinstance(model, Net) and world == 1 and strategy == "single" and result.strategy == "single"
    assert result.metrics("v") == [1.0, 1.0, 1.0]
    assert nbtrain.context().strategy == "local"  # the launch's context does not outlive it


def test_in_process_errors_are_the_users_own():
    def broken():
        raise KeyError("missing column")

    with pytest.raises(KeyError, match="missing column"):
        nbtrain.launch(broken, devices=1, accelerator="cpu", progress=False)


def test_in_process_timeout():
    with pytest.raises(WorkerError, match="timed out after 1 s") as info:
        nbtrain.launch(time.sleep, 30, devices=1, accelerator="cpu", timeout=1, progress=False)
    assert "--- rank 0 stack ---" in info.value.traceback


@pytest.mark.parametrize("kwargs, words", [
    ({"strategy": "horovod"}, "strategy='horovod' is not known. Accepted: 'auto', 'ddp', 'fsdp', 'dp', 'deepspeed' "
                              "(earlier names, still understood: 'ddp_fork'"),
    ({"start": "thread"}, "start='thread' is not known. Accepted: 'auto', 'fork', 'template', 'spawn', 'torchrun'"),
    ({"strategy": "ddp_fork", "num_nodes": 2}, "num_nodes=2 with strategy='ddp_fork' (start='fork'): several machines "
                                                "meet through torchrun's rendezvous; give start='torchrun'"),
    ({"strategy": "dp", "start": "template"}, "strategy='dp' with start='template': 'dp' runs in this kernel"),
    ({"strategy": "ddp_spawn", "start": "fork"}, "strategy='ddp_spawn' with start='fork': 'ddp_spawn' is the earlier "
                                                 "name of strategy='ddp', start='template'"),
    ({"start": "fork", "launcher_options": {"template": False}}, "launcher_options={'template': False} with "
                                                                   "start='fork'"),
    ({"start": "template", "launcher_options": {"launcher": "accelerate"}}, "launcher_options={'launcher': "
                                                                             "'accelerate'} with start='template'"),
    ({"strategy": "dp", "devices": 2, "accelerator": "cpu"}, "strategy='dp' runs one process"),
    ({"timeout": -1}, "timeout=-1: give a positive number of seconds"),
    ({"devices": "x"}, "devices='x'"),
])
def test_bad_launch_arguments(kwargs, words):
    with pytest.raises((ValueError, TypeError)) as info:
        nbtrain.launch(report_environment, progress=False, **kwargs)
    assert words in str(info.value)


def test_launch_needs_a_callable():
    with pytest.raises(TypeError, match="needs a callable training function, got int"):
        nbtrain.launch(3)


def test_auto_says_what_it_chose(capfd):
    nbtrain.launch(report_environment, devices=2, accelerator="cpu")
    out = capfd.readouterr().out
    assert "nbtrain: ddp on 2 CPU ranks, gloo (started by fork, chosen by start='auto')\n" in out
    assert "nbtrain: ddp on 2 CPU ranks, gloo\n" not in out  # said once, not twice
    assert "finished in" in out


def test_users_own_process_group_is_respected(no_leftovers):
    def own_group():
        import torch.distributed as dist

        dist.init_process_group("gloo")  # from the torchrun-standard environment
        ctx = nbtrain.context()
        total = ctx.log("n", 1.0, sync_dist=True)
        dist.destroy_process_group()
        return total

    assert nbtrain.launch(own_group, devices=2, accelerator="cpu", start="fork", progress=False).values == [1.0, 1.0]


NOTEBOOK_CELL = """
STREAM = (i for i in range(3))

def uses_a_generator():
    return next(STREAM)
"""


def test_unshippable_function_is_refused_with_its_path_before_anything_starts(no_leftovers):
    namespace = {"__name__": "__main__"}  # as in a notebook: the function travels by value
    exec(NOTEBOOK_CELL, namespace)
    uses_a_generator = namespace["uses_a_generator"]
    with pytest.raises(UnpicklableError) as info:
        nbtrain.launch(uses_a_generator, devices=2, accelerator="cpu", start="template", progress=False)
    message = str(info.value)
    assert "the function `uses_a_generator` and its arguments cannot be sent" in message
    assert "uses_a_generator.__globals__['STREAM']: generator" in message
    assert "create it inside the training function" in message


def test_unshippable_function_does_not_start_the_template(no_leftovers):
    # The pickling check comes first: a refused start='template' launch spends nothing on the template.
    namespace = {"__name__": "__main__"}
    exec(NOTEBOOK_CELL, namespace)
    nbtrain.stop_template()
    with pytest.raises(UnpicklableError, match="STREAM"):
        nbtrain.launch(namespace["uses_a_generator"], devices=2, accelerator="cpu", start="template",
                       progress=False)
    assert template_process.template(start=False) is None


def test_stack_dumps_lead_with_the_users_code():
    from nbtrain.notebook.run.stacks import tidy_stacks

    dump = ("Thread 0x1 (most recent call first):\n  File \"nbtrain/channel.py\", line 125 in _send_loop\n\n"
            "Current thread 0x2 (most recent call first):\n  File \"cell.py\", line 5 in train\n"
            "  File \"nbtrain/rank/loop.py\", line 140 in _do_run\n"
                "  File \"nbtrain/rank/loop.py\", line 101 in _execute\n  File \"ipykernel/kernelapp.py\", line 1 in start\n\n"
            "Extension modules: torch._C (total: 1)")
    assert tidy_stacks(dump) == "Current thread 0x2 (most recent call first):\n  File \"cell.py\", line 5 in train"


def matmul_threads():
    b = torch.randn(512, 512)
    (b @ b).sum()
    return torch.get_num_threads()


def test_a_single_forked_rank_computes_after_the_kernel_used_its_thread_pool(no_leftovers):
    # GNU OpenMP is not fork-safe: a fork of a process that ran a parallel region hangs in its
    # first one if it uses more than one thread. Forked ranks use one; template ranks their share.
    a = torch.randn(512, 512)
    for _ in range(3):
        a @ a
    forked = nbtrain.launch(matmul_threads, devices=1, accelerator="cpu", start="fork", progress=False, timeout=60)
    assert forked.values == [1]
    templated = nbtrain.launch(matmul_threads, devices=1, accelerator="cpu", start="template", progress=False, timeout=60)
    assert templated.values == [max(1, os.cpu_count())]


def resumed_logging(first_step):
    ctx = nbtrain.context()
    for step in range(first_step, first_step + 3):
        ctx.log("loss", 1.0 / (step + 1), sync_dist=True, step=step)
    ctx.log("loss", 0.001, sync_dist=True)  # no step: the next one
    try:
        ctx.log("loss", 1.0, step=-1)
    except ValueError as exc:
        return str(exc)


def test_a_resumed_run_logs_at_its_own_steps(no_leftovers):
    result = nbtrain.launch(resumed_logging, 150, devices=2, accelerator="cpu", start="fork", progress=False)
    assert sorted({m.step for m in result.history if m.name == "loss"}) == [150, 151, 152, 153]
    assert "step must be an int >= 0" in result.value


def slow_to_exit():
    import atexit

    atexit.register(time.sleep, 3.5)  # a library's teardown, after the rank has reported
    return nbtrain.context().rank


@pytest.mark.slow
def test_a_cell_waiting_for_ranks_to_exit_says_so(capfd, no_leftovers):
    # The live view read "finished" ~5 s before the cell ended, saying nothing of why.
    result = nbtrain.launch(slow_to_exit, devices=2, accelerator="cpu", start="torchrun", progress=False)
    assert result.values == [0, 1]
    assert "nbtrain: every rank has reported; waiting for their processes to exit" in capfd.readouterr().out


SCRIPT_WITHOUT_A_MAIN_GUARD = '''
import os, sys
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lib"))
import helper, nbtrain
print("top level ran", flush=True)

def work(x):
    return helper.double(x), sys.argv[1:], os.getpgid(0) == os.getpid()

print("result", nbtrain.launch(work, 21, devices=2, accelerator="cpu", strategy="ddp_spawn", progress=False,
                               launcher_options={"template": False}).values, flush=True)
'''


def test_spawned_ranks_import_as_the_caller_does_and_never_rerun_its_script(tmp_path):
    # The script has no `if __name__ == "__main__"` guard: run again in every rank, it would
    # launch again. Its own sys.path entry and argv reach the ranks, and each rank has a process
    # group of its own.
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "helper.py").write_text("def double(x):\n    return 2 * x\n")
    (tmp_path / "job.py").write_text(SCRIPT_WITHOUT_A_MAIN_GUARD)
    run = subprocess.run([sys.executable, str(tmp_path / "job.py"), "--lr", "3"], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("top level ran") == 1, run.stdout
    assert "result [(42, ['--lr', '3'], True), (42, ['--lr', '3'], True)]" in run.stdout, run.stdout + run.stderr
