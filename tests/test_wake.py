"""wake.Changes: a wait for a run directory is woken by a file renamed into it, or by a process's
end, not by its backstop (here an hour: a wait that returns at all was woken)."""
import os
import subprocess
import sys
import threading

import pytest

from nbtrain.common import wake

HOUR = 3600.0


def _returns(wait, within: float = 60.0) -> bool:
    done = threading.Event()
    thread = threading.Thread(target=lambda: (wait(), done.set()), daemon=True)
    thread.start()
    return done.wait(within)


@pytest.mark.skipif(sys.platform != "linux", reason="inotify and pidfd are Linux's")
def test_a_file_renamed_into_the_directory_wakes_the_wait(tmp_path):
    with wake.Changes(tmp_path) as changes:
        assert changes.woken
        (tmp_path / "status.json.tmp").write_text("{}")
        timer = threading.Timer(0.2, os.rename, (tmp_path / "status.json.tmp", tmp_path / "status.json"))
        timer.start()
        assert _returns(lambda: changes.wait(HOUR)), "the rename did not wake the wait"
        timer.join()


@pytest.mark.skipif(sys.platform != "linux", reason="inotify and pidfd are Linux's")
@pytest.mark.slow
def test_the_end_of_a_watched_process_wakes_the_wait_once(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    with wake.Changes(tmp_path) as changes:
        assert changes.watch_process(process.pid)
        threading.Timer(0.2, process.stdin.close).start()
        assert _returns(lambda: changes.wait(HOUR)), "the process's end did not wake the wait"
        process.wait()
        assert changes._pidfds == []  # heard once, then closed: the next wait is the directory's alone


def test_a_directory_that_cannot_be_watched_leaves_the_backstop(tmp_path):
    with wake.Changes(tmp_path / "missing") as changes:
        assert not changes.woken
        changes.wait(0.01)  # returns after its backstop
        assert not changes.watch_process(2**22 + 12345)  # no such process: nothing to watch
