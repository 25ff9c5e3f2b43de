"""Nothing a rank started outlives the kernel, or a submitted run's supervisor, killed with -9
(common/process_tree.py: the rank ends its tree when the notebook goes, and its watcher does
when the rank cannot); a submitted run is untouched by its kernel's end. Real kernels, real
daemons: a server in a session of its own, and an orphan whose parent exited at once."""
import os
import queue
import signal
import time

import psutil
import pytest

import nbtrain
from conftest import Kernel, running

pytestmark = pytest.mark.slow

START_DAEMONS = '''
import os, subprocess, time, nbtrain

def start_daemons(hang=True, steps=0, hold_the_gil=False):
    server = subprocess.Popen(["sleep", "300"], start_new_session=True)
    orphan = subprocess.run(["sh", "-c", "sleep 301 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
    pids = [os.getpid(), server.pid, int(orphan.stdout)]
    print("PIDS", *pids, flush=True)
    for step in range(steps):
        time.sleep(0.1)
        print("step", step, flush=True)
    if hold_the_gil:  # a regular expression's backtracking: no other thread of the rank runs for hours
        time.sleep(1)
        import re
        re.match(r"(a+)+$", "a" * 64 + "b")
    if hang:
        time.sleep(300)
    return pids
'''


def _printed_pids(kernel, ranks: int, seconds: float = 120) -> list[int]:
    """The pids the running cell's ranks printed ("PIDS rank server orphan"), once all have."""
    found: list[int] = []
    lines = 0
    deadline = time.monotonic() + seconds
    while lines < ranks and time.monotonic() < deadline:
        try:
            message = kernel.client.get_iopub_msg(timeout=0.5)
        except queue.Empty:
            continue
        if message["msg_type"] == "stream":
            for line in message["content"]["text"].splitlines():
                if "PIDS" in line:
                    found += [int(p) for p in line.split("PIDS", 1)[1].split()]
                    lines += 1
        elif message["msg_type"] == "error":
            raise AssertionError("\n".join(message["content"]["traceback"]))
    assert lines == ranks, f"only {lines} of {ranks} ranks said their pids within {seconds:g} s"
    return found


def _gone(pids, within: float = 5.0) -> list[int]:
    """Those of `pids` still running after `within` seconds (none, when all ended in time)."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(map(running, pids)):
        time.sleep(0.05)
    return [p for p in pids if running(p)]


def _end(pids) -> None:
    for pid in pids:  # what a failed test left: ours, by pid
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def _kill_kernel_and_check(kernel, pids: list[int]) -> None:
    process = kernel.manager.provisioner.process
    family = [c.pid for c in psutil.Process(process.pid).children(recursive=True)]
    every = sorted(set(pids) | set(family))
    try:
        assert set(pids) <= set(family)  # the daemons are in the kernel's tree now...
        os.kill(process.pid, signal.SIGKILL)
        process.wait(10)
        left = _gone(every)  # ... and none of it outlives the kernel
        assert not left, f"still running 5 s after the kernel's kill -9: {[(p, psutil.Process(p).cmdline()) for p in left]}"
    finally:
        _end(every)


@pytest.mark.parametrize("start", ["fork", "template", "spawn", "torchrun"])
def test_daemons_of_a_launch_end_with_a_killed_kernel(start):
    kernel = Kernel()
    try:
        _, _, error, _ = kernel.run(START_DAEMONS)
        assert error is None, error
        kernel.client.execute(f"nbtrain.launch(start_daemons, devices=2, accelerator='cpu', start={start!r}, "
                              "progress=False)")
        pids = _printed_pids(kernel, 2)
        _kill_kernel_and_check(kernel, pids)
    finally:
        kernel.client.stop_channels()
        kernel.manager.cleanup_resources()


def test_a_rank_that_holds_the_gil_is_ended_with_its_daemons_by_its_watcher():
    # The rank's own threads cannot run (its main thread never lets go of the GIL): only the
    # watcher, a process of its own, can end it and what it started.
    kernel = Kernel()
    try:
        _, _, error, _ = kernel.run(START_DAEMONS)
        assert error is None, error
        kernel.client.execute("nbtrain.launch(start_daemons, hold_the_gil=True, devices=2, accelerator='cpu', "
                              "strategy='ddp_fork', progress=False)")
        pids = _printed_pids(kernel, 2)
        busy, deadline = 0, time.monotonic() + 60
        while busy < 5 and time.monotonic() < deadline:  # in the regular expression now: running for 0.5 s on end
            running_now = all(psutil.Process(p).status() == psutil.STATUS_RUNNING for p in pids[::3])
            busy = busy + 1 if running_now else 0
            time.sleep(0.1)
        assert busy == 5, "not busy"
        _kill_kernel_and_check(kernel, pids)
    finally:
        kernel.client.stop_channels()
        kernel.manager.cleanup_resources()


@pytest.mark.parametrize("start", ["fork", "template"])
def test_daemons_of_live_ranks_end_with_a_killed_kernel(start):
    kernel = Kernel()
    try:
        _, _, error, _ = kernel.run(f"{START_DAEMONS}\nranks = nbtrain.Ranks(devices=2, accelerator='cpu', "
                                    f"start={start!r}, progress=False)")
        assert error is None, error
        pids = [p for rank in kernel.value("ranks.run(start_daemons, False).values") for p in rank]
        assert all(map(running, pids))  # between commands, what the ranks started serves on
        _kill_kernel_and_check(kernel, pids)
    finally:
        kernel.client.stop_channels()
        kernel.manager.cleanup_resources()


def test_a_submitted_run_is_untouched_by_its_kernels_kill_and_ends_its_daemons_itself(tmp_path):
    kernel = Kernel()
    try:
        _, _, error, _ = kernel.run(f"{START_DAEMONS}\nrun = nbtrain.submit(start_daemons, False, 40, devices=2, "
                                    f"accelerator='cpu', run_dir={str(tmp_path / 'run')!r})")
        assert error is None, error
        run = nbtrain.attach(tmp_path / "run")
        deadline = time.monotonic() + 120
        while "step 1" not in run.logs(1) and time.monotonic() < deadline:
            time.sleep(0.1)
        pids = [int(p) for rank in (0, 1) for line in run.logs(rank).splitlines() if line.startswith("PIDS")
                for p in line.split()[1:]]
        os.kill(kernel.manager.provisioner.process.pid, signal.SIGKILL)
        kernel.manager.provisioner.process.wait(10)
    finally:
        kernel.client.stop_channels()
        kernel.manager.cleanup_resources()
    try:
        assert len(pids) == 6
        time.sleep(1)
        assert all(map(running, pids)), "the kernel's end reached into the submitted run"
        values = run.result(timeout=120).values
        assert sorted(p for v in values for p in v) == sorted(pids)
        assert not _gone(pids), "the run ended: so did what its ranks started"
    finally:
        _end(pids)


def test_daemons_of_a_submitted_run_end_with_its_killed_supervisor(tmp_path, no_leftovers):
    notebook = {"__name__": "__main__"}  # defined as in a notebook: it travels by value
    exec(START_DAEMONS, notebook)
    run = nbtrain.submit(notebook["start_daemons"], True, 3, devices=2, accelerator="cpu", run_dir=tmp_path / "run")
    deadline = time.monotonic() + 120
    while "step 1" not in run.logs(1) and time.monotonic() < deadline:
        time.sleep(0.1)
    pids = [int(p) for rank in (0, 1) for line in run.logs(rank).splitlines() if line.startswith("PIDS")
            for p in line.split()[1:]]
    try:
        assert len(pids) == 6
        supervisor = psutil.Process(pids[0]).ppid()  # ranks forked from it
        assert "nbtrain" in " ".join(psutil.Process(supervisor).cmdline())
        os.kill(supervisor, signal.SIGKILL)
        left = _gone(pids)
        assert not left, f"still running 5 s after the supervisor's kill -9: {left}"
    finally:
        _end(pids)


def test_a_watched_rank_ends_with_its_own_code_or_signal(no_leftovers):
    # The watcher changes nothing of how a rank's end reads: a code, or a signal by name.
    def crash(how):
        import ctypes
        import os

        if nbtrain.context().rank == 1:
            if how == "code":
                os._exit(7)
            ctypes.string_at(0)  # SIGSEGV

    for how, said in (("code", "exited with code 7"), ("segv", "Signal 11 (SIGSEGV) received by PID")):
        with pytest.raises(nbtrain.WorkerError) as info:
            nbtrain.launch(crash, how, devices=2, accelerator="cpu", strategy="ddp_fork", progress=False, timeout=60)
        assert info.value.rank == 1 and said in str(info.value), str(info.value)
