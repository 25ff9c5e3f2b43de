"""Ray going away under a run (issue 29 item 6): shut down from another thread, or its cluster's
daemons killed. The run fails naming Ray within seconds, no new Ray starts behind the user's
back, and the kernel survives (its Ray driver would otherwise end it about a minute later).

A kernel of its own: these tests end the Ray they started, which the other Ray tests share.
"""
import importlib.util
import os

import pytest

from test_ray import SETUP, _close_with_ray

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="ray is not installed (pip install 'nbtrain[ray]')")]

HELPERS = '''
import threading

def ray_daemons():
    """This kernel's own Ray: the GCS and raylet it started (never another test's), still running
    (one that ended and is not yet reaped is a zombie, whose command line psutil cannot read)."""
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if p.status() != psutil.STATUS_ZOMBIE and any(name in " ".join(p.cmdline())
                                                          for name in ("gcs_server", "raylet")):
                found.append(p)
        except psutil.Error:  # ended meanwhile
            pass
    return found

def wait_until(done, seconds):
    deadline = time.monotonic() + seconds
    while not done() and time.monotonic() < deadline:
        time.sleep(0.1)
    return done()

def sleeper(seconds, up=None):
    nbtrain.context().barrier()  # both ranks are up
    if up:
        open(os.path.join(up, str(nbtrain.context().rank)), "w").close()
    time.sleep(seconds)

def lost_with_ray(action):
    """A run whose ranks sleep 2 minutes, and `action` (Ray's end) from another thread once both sleep."""
    import shutil, tempfile
    up = tempfile.mkdtemp()
    def when_both_sleep():
        wait_until(lambda: len(os.listdir(up)) == 2, 240)  # started, under the suite's load
        action()
    threading.Thread(target=when_both_sleep, daemon=True).start()
    started = time.monotonic()
    try:
        nbtrain.launch(sleeper, 120, up, devices=2, cluster=nbtrain.Ray(), progress=False, timeout=200)
    except nbtrain.WorkerError as error:
        return str(error), time.monotonic() - started
    finally:
        shutil.rmtree(up)
'''


@pytest.fixture(scope="module")
def gk():
    from conftest import Kernel

    kernel = Kernel()
    try:
        setup = SETUP.replace("TESTS_DIR", repr(os.path.dirname(os.path.abspath(__file__))))
        _, _, error, _ = kernel.run(setup + HELPERS, timeout=600)
        assert error is None, error
        yield kernel
    finally:
        _close_with_ray(kernel)


def test_ray_shut_down_under_a_run_fails_it_and_starts_no_new_ray(gk):
    _, _, error, _ = gk.run("old = {p.pid for p in ray_daemons()}\n"
                            "message, took = lost_with_ray(ray.shutdown)", timeout=300)
    assert error is None, error
    message = gk.value("message")
    assert "Ray was shut down in this kernel (ray.shutdown())" in message, message
    assert gk.value("took") < 60  # not the 120 s the ranks sleep
    assert gk.value("ray.is_initialized()") is False  # before: a new local Ray, silently
    assert gk.value("[p.pid for p in ray_daemons() if p.pid not in old]") == [], "a new Ray was started"
    # The old Ray's daemons end as ray.shutdown() (on its own thread) finishes: on a loaded 2-core
    # machine that took more than 30 s once.
    assert gk.value("wait_until(lambda: not ray_daemons(), 90)"), gk.value("[p.pid for p in ray_daemons()]")


def test_ray_daemons_killed_under_a_run_fail_it_and_the_kernel_survives(gk):
    _, _, error, _ = gk.run("start_ray()\nkill_daemons = lambda: [p.kill() for p in ray_daemons()]\n"
                            "message, took = lost_with_ray(kill_daemons)", timeout=600)
    assert error is None, error
    message = gk.value("message")
    assert "Ray's cluster went away: its GCS at" in message, message
    assert gk.value("took") < 60
    # The driver is shut down, so it cannot end the kernel (measured: alive 90 s after, where
    # before the kernel's process exited ~61 s after the daemons).
    assert gk.value("ray.is_initialized()") is False
    _, _, error, _ = gk.run("try:\n    nbtrain.launch(sleeper, 1, devices=2, cluster=nbtrain.Ray(), progress=False)\n"
                            "except RuntimeError as e:\n    again = str(e)")
    assert error is None, error
    again = gk.value("again")
    assert "Ray's cluster went away" in again and "ray.init(" in again  # not a new local Ray


def test_live_ranks_on_ray_end_within_seconds_of_a_killed_kernel():
    # Measured 60.5 s before (the goal: seconds, as with the other placements).
    import signal
    import time

    import psutil

    from conftest import Kernel, this_workers

    def actors():
        return [p for p in psutil.process_iter(["cmdline"])
                if any("RankActor" in x for x in p.info["cmdline"] or ()) and this_workers(p)]

    kernel = Kernel()
    pid = kernel.manager.provisioner.pid
    started = []
    try:
        # ray.init tried again as test_ray's start_ray does: Ray's raylet has a fixed 30 s to
        # register, which a loaded machine can miss
        _, _, error, _ = kernel.run("import ray, nbtrain\nfor _ in range(3):\n    try:\n"
                                    "        ray.init(num_cpus=2, include_dashboard=False)\n        break\n"
                                    "    except Exception:\n        ray.shutdown()\n"
                                    "ranks = nbtrain.Ranks(devices=2, cluster=nbtrain.Ray(), progress=False)\n"
                                    "pids = ranks.eval('__import__(\"os\").getpid()')", timeout=300)
        assert error is None, error
        ours = set(kernel.value("pids"))
        started = psutil.Process(pid).children(recursive=True)
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while {p.pid for p in actors()} & ours and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not {p.pid for p in actors()} & ours, "the ranks outlived their kernel by 10 s"
    finally:
        try:
            kernel.close()  # its connection file and ports; the process is gone already
        except Exception:
            pass
        for proc in started:  # the kernel's own Ray daemons, orphaned by the kill
            try:
                proc.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(started, timeout=30)
