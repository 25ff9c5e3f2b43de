"""A kernel's one watcher of the ranks it starts (common/kernel_watcher.py, watcher.py --kernel):
one process per kernel, reused by every launch, which ends the ranks still running and what they
started once the kernel is killed, leaves a process that merely took a rank's pid alone, and exits
once the kernel is gone and nothing is left to end. Real kernels: this pytest process, plain
Python parents killed with -9, a real Jupyter kernel."""
import glob
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil
import pytest

import nbtrain
from conftest import Kernel, running

pytestmark = pytest.mark.slow


def watchers_of(kernel: int, seconds: float = 30) -> list[int]:
    """The pids of the watchers running for `kernel` (by their command line), once each is the
    watcher itself: the process the kernel started forks it and exits at once."""
    deadline = time.monotonic() + seconds
    while True:
        found = []
        for process in psutil.process_iter(["cmdline", "ppid"]):
            line = process.info["cmdline"] or []
            if any(arg.endswith("watcher.py") for arg in line) and line[-5:-3] == ["--kernel", str(kernel)]:
                found.append((process.pid, process.info["ppid"]))
        if (found and all(ppid != kernel for _, ppid in found)) or time.monotonic() > deadline:
            return [pid for pid, _ in found]
        time.sleep(0.05)


def _gone(pids, within: float = 5.0) -> list[int]:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and any(map(running, pids)):
        time.sleep(0.05)
    return [p for p in pids if running(p)]


def _in_the_expression(ranks, seconds: float = 60) -> None:
    """Wait until each of `ranks` has spent a second in its regular expression (holding the GIL)."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline and not all(psutil.Process(p).cpu_times().user > 1 for p in ranks):
        time.sleep(0.1)


def _end(pids) -> None:
    for pid in pids:  # what a failed test left: ours, by pid
        if running(pid):
            os.kill(pid, signal.SIGKILL)


def _rank_view():
    import os
    import threading

    import psutil

    return os.getpid(), [t.name for t in threading.enumerate()], [c.pid for c in psutil.Process().children()]


def test_one_watcher_serves_every_launch_of_a_kernel_and_is_no_leftover(no_leftovers):
    seen = set()
    for start in ("fork", "fork", "spawn", "fork"):
        values = nbtrain.launch(_rank_view, devices=2, accelerator="cpu", start=start, progress=False).values
        for _, threads, children in values:
            # Registered with the kernel's watcher: no watcher of its own, no watchdog thread.
            assert children == [] and "nbtrain-watchdog" not in threads, (start, threads, children)
        seen.update(watchers_of(os.getpid()))
    assert len(seen) == 1, f"one watcher for the kernel's life, not {seen}"
    assert running(seen.pop())  # kept for the next launch; no child of this process (no_leftovers)


def test_a_watcher_that_was_killed_is_replaced_at_the_next_launch(no_leftovers):
    nbtrain.launch(_rank_view, devices=2, accelerator="cpu", start="fork", progress=False)
    first = watchers_of(os.getpid())
    assert len(first) == 1
    os.kill(first[0], signal.SIGKILL)  # ours: started by this process's first launch
    assert not _gone(first)
    values = nbtrain.launch(_rank_view, devices=2, accelerator="cpu", start="fork", progress=False).values
    assert all(children == [] and "nbtrain-watchdog" not in threads for _, threads, children in values)
    second = watchers_of(os.getpid())
    assert len(second) == 1 and second != first
    directories = glob.glob(os.path.join(tempfile.gettempdir(), f"nbtrain-watch-{os.getpid()}-*"))
    assert len(directories) == 1, f"the killed watcher's directory stayed: {directories}"


# A plain Python parent as the kernel: it launches ranks that start a server in a session of its
# own and an orphan, say every pid, and hold the GIL (a regular expression's backtracking, for
# hours): none of a rank's own threads can run, so only the watcher can end it and its daemons.
PARENT = '''
import os, re, subprocess, sys, nbtrain

def start_daemons(hang):
    server = subprocess.Popen(["sleep", "300"], start_new_session=True)
    orphan = subprocess.run(["sh", "-c", "sleep 301 >/dev/null 2>&1 & echo $!"], capture_output=True, text=True)
    if hang:
        print("PIDS", os.getpid(), server.pid, int(orphan.stdout), flush=True)
        re.match(r"(a+)+$", "a" * 64 + "b")
    server.kill()
    server.wait()
    os.kill(int(orphan.stdout), 9)
    return os.getpid()

if __name__ == "__main__":
    ended = nbtrain.launch(start_daemons, False, devices=2, accelerator="cpu", start=sys.argv[1], progress=False)
    print("ENDED", *ended.values, flush=True)  # ranks that ended: forgotten by the watcher
    if sys.argv[2] == "fork-too" and os.fork() == 0:  # the user's own fork of a kernel, launching ranks of its own
        print("CHILD", os.getpid(), flush=True)
        nbtrain.launch(start_daemons, True, devices=2, accelerator="cpu", start="fork", progress=False)
    nbtrain.launch(start_daemons, True, devices=2, accelerator="cpu", start=sys.argv[1], progress=False)
'''


def _parent(tmp_path, start: str, also: str = "") -> subprocess.Popen:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    return subprocess.Popen([sys.executable, str(script), start, also or "-"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)


def _said(parent: subprocess.Popen, lines: int) -> list[list[int]]:
    """The pids the parent's processes printed (a rank's lines carry its tag), a list per line, once
    `lines` such lines came."""
    said = []
    while len(said) < lines:
        line = parent.stdout.readline()
        assert line, f"the parent ended early (code {parent.poll()})"
        words = line.split()
        tagged = [i for i, word in enumerate(words) if word in ("PIDS", "ENDED", "CHILD")]
        if tagged:
            said.append([int(p) for p in words[tagged[0] + 1:]])
    return said


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_a_killed_parents_watcher_ends_its_ranks_and_their_daemons_then_exits(tmp_path, start):
    parent = _parent(tmp_path, start)
    every: list[int] = []
    try:
        said = _said(parent, 3)
        ended, running_ = said[0], said[1] + said[2]
        every = running_ + [parent.pid]
        watcher = watchers_of(parent.pid)
        assert len(watcher) == 1 and psutil.Process(watcher[0]).ppid() != parent.pid
        every += watcher
        assert all(map(running, running_)) and not any(map(running, ended))
        _in_the_expression(running_[::3])
        directory = glob.glob(os.path.join(tempfile.gettempdir(), f"nbtrain-watch-{parent.pid}-*"))
        assert len(directory) == 1
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        left = _gone(running_)
        assert not left, f"still running 5 s after the parent's kill -9: {left}"
        assert not _gone(watcher), "the watcher outlived what it had to end"
        assert not os.path.exists(directory[0])  # its directory (its socket's) went with it
    finally:
        _end(every)
        parent.stdout.close()


def test_a_forked_kernel_has_a_watcher_of_its_own(tmp_path):
    # The user's os.fork of a kernel that launched: the child's launch starts a watcher of the
    # child's; killing the child ends the child's ranks and leaves the parent's running.
    parent = _parent(tmp_path, "fork", "fork-too")
    every: list[int] = []
    try:
        said = _said(parent, 6)
        child = next(line[0] for line in said if len(line) == 1)
        ranks = [line for line in said if len(line) == 3]
        every = [p for line in ranks for p in line] + [parent.pid, child]
        mine = [p for line in ranks if psutil.Process(line[0]).ppid() == child for p in line]
        theirs = [p for line in ranks if psutil.Process(line[0]).ppid() == parent.pid for p in line]
        assert len(mine) == len(theirs) == 6
        watchers = watchers_of(parent.pid) + watchers_of(child)
        every += watchers
        assert len(watchers) == 2 and len(set(watchers)) == 2
        _in_the_expression(mine[::3])
        os.kill(child, signal.SIGKILL)
        left = _gone(mine)
        assert not left, f"the child's ranks outlived it: {left}"
        assert all(map(running, theirs + [parent.pid, watchers[0]])), "the parent's were touched"
        assert not _gone([watchers[1]])
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert not _gone(theirs + [watchers[0]])
    finally:
        _end(every)
        parent.stdout.close()


REGISTER_AND_END = '''
import os, sys
from nbtrain.common import kernel_watcher

address = kernel_watcher.address()
print(address, flush=True)
sys.stdin.readline()  # the test stops the watcher meanwhile
pid = os.fork()
if pid == 0:
    kernel_watcher.register(address)  # queued: the stopped watcher reads it later
    os._exit(0)
os.waitpid(pid, 0)  # ended and reaped: its pid is free to be taken
print(pid, flush=True)
sys.stdin.readline()
'''


def _take_pid(pid: int) -> subprocess.Popen | None:
    """A `sleep` that got `pid`: Linux's next pid set just below it (root only), tried a few times."""
    for _ in range(50):
        try:
            with open("/proc/sys/kernel/ns_last_pid", "w") as last:
                last.write(str(pid - 1))
        except OSError:
            return None
        sleeper = subprocess.Popen(["sleep", "300"])
        if sleeper.pid == pid:
            return sleeper
        sleeper.kill()
        sleeper.wait()
    return None


def test_a_rank_registered_after_it_ended_leaves_its_pids_next_owner_alone(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("taking a given pid needs root (/proc/sys/kernel/ns_last_pid)")
    script = tmp_path / "parent.py"
    script.write_text(REGISTER_AND_END)
    parent = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    every = [parent.pid]
    try:
        parent.stdout.readline()
        watcher = watchers_of(parent.pid)
        every += watcher
        os.kill(watcher[0], signal.SIGSTOP)
        parent.stdin.write("\n")
        parent.stdin.flush()
        ended = int(parent.stdout.readline())
        sleeper = _take_pid(ended)
        if sleeper is None:
            pytest.skip(f"pid {ended} was taken by another process of this busy machine 50 times")
        every.append(sleeper.pid)
        os.kill(watcher[0], signal.SIGCONT)  # it reads the ended rank's registration now
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(10)
        assert not _gone(watcher), "the watcher did not exit once its kernel was gone"
        assert sleeper.poll() is None, "the watcher ended the process that took an ended rank's pid"
        sleeper.kill()
        sleeper.wait()
    finally:
        _end(every)
        parent.stdin.close()
        parent.stdout.close()


def test_a_jupyter_kernels_watcher_ends_live_ranks_and_exits_with_the_kernel():
    kernel = Kernel()
    pid = kernel.manager.provisioner.process.pid
    every: list[int] = []
    try:
        _, _, error, _ = kernel.run("import nbtrain\nranks = nbtrain.Ranks(devices=2, accelerator='cpu', start='fork')\n"
                                    "first = nbtrain.launch(lambda: 1, devices=2, accelerator='cpu', progress=False)")
        assert error is None, error
        ranks = kernel.value("ranks.eval('__import__(\"os\").getpid()')")
        watcher = watchers_of(pid)
        every = ranks + watcher
        assert len(watcher) == 1 and all(map(running, ranks))
        kernel.client.execute("ranks.exec('import re; re.match(r\"(a+)+$\", \"a\" * 64 + \"b\")')")  # the GIL, held
        _in_the_expression(ranks)
        os.kill(pid, signal.SIGKILL)
        kernel.manager.provisioner.process.wait(10)
        assert not _gone(ranks), "the kernel's ranks outlived it"
        assert not _gone(watcher), "the watcher outlived the kernel and its ranks"
    finally:
        _end(every)
        kernel.client.stop_channels()
        kernel.manager.cleanup_resources()
