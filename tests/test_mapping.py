"""nbtrain.map and Ranks.map with real processes: input order, a work queue rather than a static
split (skewed items), MapError naming the failing item, resume from run_dir, the live ranks' own
names, Ctrl-C in a real kernel; and the one-line refusals of bad input."""
import functools
import os
import stat
import struct
import time
from pathlib import Path

import pytest

import nbtrain
from conftest import CHILDREN
from nbtrain.notebook.live.work_queue import SavedResults

KEEP_THE_TEMPLATE = True  # the workers are the template's forks: one for the module (conftest.py)

# -- bad input and the saved results: no process ---------------------------------------------

@pytest.mark.parametrize("call, expected", [
    (lambda: nbtrain.map(len, 5), "items=5: give the items to map over as a list"),
    (lambda: nbtrain.map(len, "abc"), "items='abc'"),
    (lambda: nbtrain.map(len, [1], batch_size=0), "batch_size=0: give a whole number, 1 or more."),
    (lambda: nbtrain.map(3, [1]), "map(fn=...) needs a callable"),
    (lambda: nbtrain.map(len, [1], devices=0, accelerator="cpu"), "devices=0"),
    (lambda: nbtrain.map(len, [1], progress=2), "progress=2"),
])
def test_bad_input_is_refused_in_one_line(call, expected):
    with pytest.raises((ValueError, TypeError)) as caught:
        call()
    assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_saved_results_are_private_and_a_cut_record_is_dropped(tmp_path):
    import dill

    saved = SavedResults(tmp_path / "run", 4)
    saved.add([0, 1], dill.dumps(["a", "b"]))
    saved.add([3], dill.dumps(["d"]))
    saved.close()
    with open(tmp_path / "run" / "results.bin", "ab") as f:  # a record the kernel died writing
        f.write(struct.pack("!QI", 1000, 1) + b"\x00" * 20)
    assert stat.S_IMODE(os.stat(tmp_path / "run").st_mode) == 0o700
    assert {stat.S_IMODE(os.stat(p).st_mode) for p in (tmp_path / "run").iterdir()} == {0o600}
    again = SavedResults(tmp_path / "run", 4)
    assert again.values() == {0: "a", 1: "b", 3: "d"}
    again.add([2], dill.dumps(["c"]))  # appended after the last whole record
    again.close()
    assert SavedResults(tmp_path / "run", 4).values() == {0: "a", 1: "b", 2: "c", 3: "d"}
    with pytest.raises(ValueError, match="holds a map of 4 items; this map has 5"):
        SavedResults(tmp_path / "run", 5)


def test_items_are_drawn_from_the_iterable_only_as_workers_ask():
    from nbtrain.common import protocol
    from nbtrain.notebook.live.work_queue import WorkQueue

    drawn: list[int] = []

    def numbers(n: int):  # an iterator: no length, never made a list
        for i in range(n):
            drawn.append(i)
            yield i

    work = WorkQueue(numbers(10_000), 1, None, {})
    try:
        assert work.total is None
        handed = work._hand_out(0, 2)
        assert [index for index, _ in handed.batch] == [0, 1] and drawn == [0, 1]
        assert isinstance(work._hand_out(1, 3), protocol.Items) and drawn == [0, 1, 2, 3, 4]
    finally:
        work.close()
    short = WorkQueue(numbers(1), 1, None, {})
    try:
        assert [i for i, _ in short._hand_out(0, 4).batch] == [0] and short.total == 1  # counted at its end
        assert isinstance(short._hand_out(0, 4), protocol.NoMoreItems)
    finally:
        short.close()


def test_a_result_that_cannot_be_saved_names_saving_not_the_item(tmp_path, small_disk):
    import dill

    from nbtrain.common import protocol
    from nbtrain.notebook.live.work_queue import WorkQueue

    disk = small_disk("64k")
    work = WorkQueue(range(2), 1, SavedResults(disk / "run", 2), {})
    try:
        work._hand_out(0, 1)
        work._handle(protocol.ItemsDone(0, [0], dill.dumps([b"x" * 200_000])))  # more than the disk holds
        error = work.error()
    finally:
        work.close()
    assert error is not None and str(error).startswith(
        f"item 0 failed: its result came back but could not be saved in {disk / 'run' / 'results.bin'}: "
        "No space left on device")
    assert "cannot be read in the notebook" not in str(error)


# -- real workers ---------------------------------------------------------------------------

def square(x):
    import torch

    return x * x, os.getpid(), torch.get_num_threads(), tuple(sorted(os.sched_getaffinity(0)))


@pytest.mark.slow
def test_results_come_back_in_input_order_from_several_workers(no_leftovers):
    results = nbtrain.map(square, range(30), devices=2, accelerator="cpu", progress=False)
    assert [r[0] for r in results] == [x * x for x in range(30)]
    assert os.getpid() not in {r[1] for r in results}
    # Each worker has its slot's share of the cores, as a launch's ranks do: 2 workers never ask for more threads
    # than there are cores, and each runs on cores of its own.
    cpus = len(os.sched_getaffinity(0))
    assert {r[2] for r in results} == {max(1, cpus // 2)}
    cores = {r[1]: r[3] for r in results}
    if cpus >= 2 and len(cores) == 2:
        first, second = cores.values()
        assert not set(first) & set(second), cores


def wait_for_the_others(marks: str, total: int, x: int):
    """Item 0 waits until every other item is done: with a static split its worker would hold
    half of them, and wait forever (here: a minute, then fail)."""
    if x == 0:
        deadline = time.monotonic() + 60
        while len(os.listdir(marks)) < total - 1:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(os.listdir(marks))} of the other items were done")
            time.sleep(0.05)
    else:
        Path(marks, str(x)).touch()
    return x, os.getpid()


@pytest.mark.slow
def test_items_go_to_whichever_worker_is_free(tmp_path, no_leftovers):
    results = nbtrain.map(functools.partial(wait_for_the_others, str(tmp_path), 12), range(12), devices=2,
                          accelerator="cpu", progress=False)
    assert [r[0] for r in results] == list(range(12))
    slow_worker = results[0][1]
    assert all(pid != slow_worker for _, pid in results[1:])  # the other worker did all the rest


def fails_at(bad: int, x: int):
    if x == bad:
        raise KeyError(f"no item {x}")
    return -x


@pytest.mark.slow
def test_a_failing_item_is_named_with_its_traceback_and_the_results_so_far(no_leftovers):
    with pytest.raises(nbtrain.MapError) as caught:
        nbtrain.map(functools.partial(fails_at, 5), range(8), devices=1, accelerator="cpu", progress=False)
    error = caught.value
    assert error.index == 5 and error.summary == "KeyError: 'no item 5'"
    assert 'raise KeyError(f"no item {x}")' in error.traceback
    assert error.results == {i: -i for i in range(5)}  # one worker: every item before it, in order
    assert str(error).startswith("item 5 failed: KeyError: 'no item 5' (5 of 8 items done")


def dies_at(bad: int, x: int):
    if x == bad:
        os._exit(3)  # the worker's process ends: no exception to report
    return x


@pytest.mark.slow
def test_a_worker_that_dies_names_the_item_it_held(no_leftovers):
    with pytest.raises(nbtrain.MapError) as caught:
        nbtrain.map(functools.partial(dies_at, 4), range(8), devices=1, accelerator="cpu", progress=False)
    assert caught.value.index == 4 and caught.value.summary.startswith("its worker failed: rank 0 failed: exited with code 3")
    assert caught.value.results == {i: i for i in range(4)}


@pytest.mark.slow
def test_a_return_value_that_cannot_be_pickled_is_named_as_the_return_value(no_leftovers):
    with pytest.raises(nbtrain.MapError) as caught:
        nbtrain.map(lambda x: (i for i in range(x)), [1, 2], devices=1, accelerator="cpu", progress=False)
    assert caught.value.summary == (
        "its return value cannot travel back to the notebook: the return value is a generator (cannot pickle "
        "'generator' object); return the items themselves, e.g. list(...) of it, not the generator")
    assert "--- item 0 ---\nfn's return value cannot travel back to the notebook." in str(caught.value)


def total(x):
    return float(x.sum())


@pytest.mark.slow
def test_a_large_tensor_item_goes_through_shared_memory_not_the_notebooks_memory(no_leftovers):
    import glob
    import tracemalloc

    import torch

    items = [torch.ones(16 << 20), torch.full((16 << 20,), 2.0)]  # 64 MiB each
    tracemalloc.start()
    try:
        results = nbtrain.map(total, items, devices=1, accelerator="cpu", progress=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert results == [16 << 20, 2 * (16 << 20)]
    assert peak < 16 << 20, f"{peak:,} bytes of the notebook's memory at the peak for 2 items of 64 MiB"
    assert not glob.glob(f"/dev/shm/nbtrain-{os.getpid()}-*")  # every file mapped and removed, or removed at the end


def batch_of_squares(xs):
    return [x * x for x in xs]


@pytest.mark.slow
def test_batches(no_leftovers):
    assert nbtrain.map(batch_of_squares, range(11), devices=2, accelerator="cpu", batch_size=4,
                       progress=False) == [x * x for x in range(11)]
    with pytest.raises(nbtrain.MapError, match="returns one result per item: it returned 1 for 4 items") as caught:
        nbtrain.map(lambda xs: [0], range(8), devices=1, accelerator="cpu", batch_size=4, progress=False)
    assert caught.value.batch == (0, 1, 2, 3) and str(caught.value).startswith("the batch of items 0, 1, 2, 3 failed")


def counted(marks: str, fail: str, x: int):
    Path(marks, f"{x}.{time.monotonic_ns()}").touch()  # every call, kept
    if x == 6 and os.path.exists(fail):
        raise RuntimeError("not yet")
    return x * 10


@pytest.mark.slow
def test_run_dir_resumes_where_the_map_stopped(tmp_path, no_leftovers):
    marks, fail, run_dir = tmp_path / "marks", tmp_path / "fail", tmp_path / "run"
    marks.mkdir()
    fail.touch()
    fn = functools.partial(counted, str(marks), str(fail))
    with pytest.raises(nbtrain.MapError) as caught:
        nbtrain.map(fn, range(10), devices=1, accelerator="cpu", run_dir=run_dir, progress=False)
    assert caught.value.index == 6
    fail.unlink()
    assert nbtrain.map(fn, range(10), devices=1, accelerator="cpu", run_dir=run_dir, progress=False) == [
        x * 10 for x in range(10)]
    calls = sorted(int(p.name.split(".")[0]) for p in marks.iterdir())
    assert calls == [0, 1, 2, 3, 4, 5, 6, 6, 7, 8, 9]  # items done before are not run again


model = "the notebook's model: never sent to the ranks"  # they have their own
OFFSET = 1000  # the ranks lack it: it comes from here, as a notebook's name would
MARKS = ""


def predict(x):
    if ctx.rank == 0:  # noqa: F821 (`ctx` is the rank's)
        Path(MARKS, str(x)).touch()
    else:  # rank 1 is slow: its first item waits for ten of rank 0's (a static split would give it half)
        deadline = time.monotonic() + 60
        while len(os.listdir(MARKS)) < 10 and time.monotonic() < deadline:
            time.sleep(0.05)
    return model["scale"] * x + OFFSET, ctx.rank  # noqa: F821


@pytest.mark.slow
def test_live_ranks_map_with_their_own_names(tmp_path, no_leftovers):
    global MARKS
    MARKS = str(tmp_path)
    with nbtrain.Ranks(devices=2, accelerator="cpu", progress=False) as ranks:
        ranks.exec("model = {'scale': 10}")
        results = ranks.map(predict, range(20))
        assert [r[0] for r in results] == [10 * x + 1000 for x in range(20)]
        done_by = [r[1] for r in results]
        assert done_by.count(0) > done_by.count(1)  # rank 1 is slow: rank 0 takes more
        with pytest.raises(nbtrain.MapError) as caught:
            ranks.map(lambda x: 1 / (x - 3), range(6))
        assert caught.value.index == 3 and "ZeroDivisionError" in caught.value.summary
        assert ranks.eval("model") == [{"scale": 10}] * 2  # the ranks were interrupted, not restarted


SETUP = '''
import os, time, nbtrain

def slow(x):
    time.sleep(0.5)
    return x
''' + CHILDREN


@pytest.mark.slow
def test_ctrl_c_in_a_kernel_stops_every_worker_and_keeps_the_results(kernel, tmp_path):
    _, _, error, _ = kernel.run(SETUP)
    assert error is None, error
    run_dir = tmp_path / "map"
    kernel.client.execute(f"nbtrain.map(slow, range(400), devices=2, accelerator='cpu', run_dir={str(run_dir)!r}, "
                          "progress=False)")
    results = run_dir / "results.bin"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not (results.exists() and results.stat().st_size > 0):
        time.sleep(0.2)
    kernel.manager.interrupt_kernel()
    while True:
        reply = kernel.client.get_shell_msg(timeout=60)
        if reply["msg_type"] == "execute_reply":
            break
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    said = reply["content"]["traceback"][0]
    assert "nbtrain stopped every worker" in said and f"saved in {run_dir}" in said
    assert kernel.value("children()") == []
    saved = SavedResults(run_dir, 400)
    done = len(saved.values())
    saved.close()
    assert 0 < done < 400


ENDLESS = '''
import itertools
drawn = 0

def numbers(marker):  # draws are counted: a map takes items only as its workers ask
    global drawn
    for i in itertools.count():
        drawn = i + 1
        if i == 0:
            open(marker, "w").close()
        yield i
'''


def interrupt_and_reply(kernel) -> dict:
    kernel.manager.interrupt_kernel()
    while True:
        reply = kernel.client.get_shell_msg(timeout=30)  # the old map drew an endless iterable for ever
        if reply["msg_type"] == "execute_reply":
            return reply


@pytest.mark.slow
def test_ctrl_c_stops_a_map_over_an_endless_iterable(kernel, tmp_path):
    _, _, error, _ = kernel.run(SETUP + ENDLESS)
    assert error is None, error
    marker, run_dir = tmp_path / "first", tmp_path / "map"
    kernel.client.execute(f"nbtrain.map(slow, numbers({str(marker)!r}), devices=2, accelerator='cpu', "
                          f"run_dir={str(run_dir)!r}, progress=False)")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not marker.exists():
        time.sleep(0.1)
    time.sleep(2)  # the workers run items of 0.5 s: a few are done, a few held
    reply = interrupt_and_reply(kernel)
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    saved = SavedResults(run_dir, None)
    done = len(saved.values())
    saved.close()
    assert reply["content"]["traceback"][0].startswith(f"KeyboardInterrupt: the map was interrupted; nbtrain "
                                                       f"stopped every worker. {done} results were in")
    assert kernel.value("drawn") <= done + 2  # at most an item in each worker's hands, never the iterable
    kernel.client.execute("nbtrain.map(slow, itertools.count(), devices=2, accelerator='cpu', progress=False)")
    time.sleep(3)
    assert interrupt_and_reply(kernel)["content"]["ename"] == "KeyboardInterrupt"
    assert kernel.value("children()") == []


@pytest.mark.slow
def test_ctrl_c_of_a_map_on_live_ranks_keeps_them_and_says_so(kernel):
    _, _, error, _ = kernel.run(SETUP + "ranks = nbtrain.Ranks(devices=2, accelerator='cpu', progress=False)\n"
                                "ranks.exec('state = 7')")
    assert error is None, error
    kernel.client.execute("ranks.map(slow, range(400), progress=False)")
    time.sleep(4)
    reply = interrupt_and_reply(kernel)
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    said = reply["content"]["traceback"][0]
    assert said.startswith("KeyboardInterrupt: the map was interrupted; the live ranks [0, 1] were interrupted; "
                           "their state is kept.") and "nbtrain stopped every worker" not in said
    assert kernel.value("ranks.eval('state')") == [7, 7]
    kernel.run("ranks.close()")
