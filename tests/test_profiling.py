"""launch(..., profile=...): torch.profiler on every rank, a trace per rank, a table naming the slowest."""
import json
import os
import re
import sys
import time

import pytest
import torch

import nbtrain
from nbtrain.display.profile import WORDS

CPU2 = {"devices": 2, "accelerator": "cpu", "start": "fork", "progress": False, "timeout": 120}


def ddp_train(steps: int, straggler: int | None = None):
    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = ctx.loader(torch.utils.data.TensorDataset(torch.randn(steps * 16, 32), torch.randn(steps * 16, 1)),
                        batch_size=8)
    for x, y in ctx.progress(loader):
        if ctx.rank == straggler:
            time.sleep(0.03)  # this rank's own slowness: the other waits for it in all_reduce
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()


def nap():
    time.sleep(0.03)  # the straggler's own line: no operator runs here


def sleepy_train(steps: int):
    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Linear(8, 1))
    for _ in ctx.progress(range(steps)):
        if ctx.rank == 1:
            nap()
        model(torch.randn(4, 8)).sum().backward()


@pytest.mark.slow
def test_a_straggler_outside_operators_is_told_by_its_own_line(tmp_path, no_leftovers):
    result = nbtrain.launch(sleepy_train, 8, profile=True, run_dir=tmp_path, **CPU2)
    table = result.profile
    line = nap.__code__.co_firstlineno + 1
    assert table.slowest() == 1
    assert table.frames(1)[0][0] == f"test_profiling.py:{line} nap()", table.frames(1)
    assert table.frames(1)[0][1] > 0.015  # most of its 30 ms outside operators
    assert table.frames(0) == []  # rank 0 waits in all_reduce: its operators tell it
    row = [r for r in table.rows() if r[0] == "1"][0]
    assert row[-1].startswith(f"outside operators: test_profiling.py:{line} nap() "), row
    assert f", at test_profiling.py:{line} nap(); rank 0 waits for it" in table.verdict(), table.verdict()


@pytest.mark.slow
def test_a_profiled_ddp_run_has_each_ranks_trace_and_names_the_wait(tmp_path, no_leftovers):
    result = nbtrain.launch(ddp_train, 8, 1, profile=True, run_dir=tmp_path, **CPU2)
    table = result.profile
    traces = table.traces()
    assert sorted(traces) == [0, 1]
    for rank, path in traces.items():
        assert os.path.dirname(path) == str(tmp_path / "profile") and f"rank{rank}" in os.path.basename(path)
        with open(path) as f:
            events = json.load(f)["traceEvents"]
        assert any("all_reduce" in e.get("name", "") for e in events)  # the collective is in each trace
    assert table.slowest() == 1
    assert table.share(0, "communication") > table.share(1, "communication") + 0.25
    verdict = table.verdict()
    assert verdict.startswith("slowest: rank 1, ") and "rank 0 waits for it: " in verdict, verdict
    assert "waiting in gloo:all_reduce" in verdict and "idle" in verdict, verdict
    text, page = repr(table), table._repr_html_()
    assert text.splitlines()[0] == f"Profile of 2 ranks: {verdict}"
    assert [line.split()[0] for line in text.splitlines()[1:]] == ["rank", "0", "1"]
    assert "<table>" in page and "communication" in page and "gloo:all_reduce" in page


def test_explicit_steps_set_the_window_in_process(tmp_path):
    def train():
        ctx = nbtrain.context()
        x = torch.randn(256, 256)  # a matmul of about a millisecond: computing, not Python, leads the step
        for _ in range(6):
            x = torch.tanh(x @ x)
            ctx.step()

    result = nbtrain.launch(train, devices=1, accelerator="cpu", progress=False, run_dir=tmp_path,
                            profile=nbtrain.Profile(steps=range(2, 5)))
    (summary,) = result.profile.ranks.values()
    assert summary["steps"] == 3 and summary["step_time"] > 0
    assert summary["split"]["compute"] > 0 and summary["split"]["communication"] == 0
    assert "aten::" in repr(result.profile)  # the top operators (aten::matmul, aten::tanh)
    # The verdict names the step's largest share: computing on a quiet machine, idle where other
    # processes take the core between operators (the suite's other workers).
    leader = max(summary["split"], key=summary["split"].get)
    assert leader in ("compute", "idle"), summary["split"]
    verdict = result.profile.verdict()
    assert verdict.startswith("rank 0: ") and WORDS[leader].split(" (")[0] in verdict
    assert (tmp_path / "profile" / "rank0.pt.trace.json").exists()


def test_a_window_the_run_never_reaches_says_so(tmp_path):
    def train():
        for _ in nbtrain.context().progress(range(2)):
            pass

    result = nbtrain.launch(train, devices=1, accelerator="cpu", progress=False, run_dir=tmp_path,
                            profile=nbtrain.Profile(steps=range(10, 12)))
    assert result.profile.verdict() == "no rank profiled a step: no step of steps 10-11 was reached (2 steps ran)"


@pytest.mark.parametrize("profile, words", [
    ("yes", "profile='yes': give True, False or nbtrain.Profile("),
    (42, "profile=42: give True, False or nbtrain.Profile("),
])
def test_bad_profile_arguments_are_refused(profile, words, tmp_path):
    with pytest.raises(ValueError) as caught:
        nbtrain.launch(lambda: None, devices=1, accelerator="cpu", progress=False, run_dir=tmp_path, profile=profile)
    assert str(caught.value).startswith(words) and "\n" not in str(caught.value)


@pytest.mark.parametrize("settings, words", [
    ({"steps": 0}, "Profile(steps=0): give a number of steps (1 to 100) or a range"),
    ({"steps": -3}, "Profile(steps=-3): give a number of steps (1 to 100) or a range"),
    ({"steps": "5"}, "Profile(steps='5'): give a number of steps (1 to 100)"),
    ({"steps": True}, "Profile(steps=True): give a number of steps (1 to 100)"),
    ({"steps": range(5, 2)}, "Profile(steps=range(5, 2)): give a number of steps"),
    ({"steps": range(0, 10, 2)}, "Profile(steps=range(0, 10, 2)): give a number of steps"),
    ({"steps": 3000}, ("Profile(steps=3000): at most 100 steps. The profiler keeps every operator of the window "
                       "in each rank's memory")),
    ({"steps": range(10, 10 + 101)}, "Profile(steps=range(10, 111)): at most 100 steps."),
    ({"activities": "cpu"}, "Profile(activities='cpu'): give a list of activities, such as ['cpu'] or ['cpu', 'cuda']"),
    ({"activities": []}, "Profile(activities=[]): give a list of activities"),
    ({"activities": ("tpu",)}, "Profile(activities=('tpu',)): ['tpu'] not known. Accepted: 'cpu', 'cuda'."),
    ({"memory": "yes"}, "Profile(memory='yes'): give True, False or None"),
])
def test_bad_profile_settings_are_refused_where_they_are_written(settings, words):
    with pytest.raises(ValueError) as caught:
        nbtrain.Profile(**settings)
    assert str(caught.value).startswith(words) and "\n" not in str(caught.value), str(caught.value)


def test_the_largest_window_and_a_list_of_activities_are_taken():
    assert len(nbtrain.Profile(steps=100).window) == 100
    assert nbtrain.Profile(steps=range(10_000, 10_100), activities=["cpu"]).window.start == 10_000


# -- the summary, from events built by hand (torch's own FunctionEvent, as profiler.events() gives) --

def _event(name, thread, start_us, end_us, parent=None):
    from torch.autograd.profiler_util import FunctionEvent

    event = FunctionEvent(0, name, thread, start_us, end_us)
    if parent is not None:
        event.set_cpu_parent(parent)
    return event


def _two_steps():
    """Two 1 ms steps on thread 1, a collective on gloo's thread 2:
    step A: data 0-100, compute 100-600, all_reduce 500-900 (over compute), idle 900-1000;
    step B: compute 1000-1400, idle 1400-1900, all_reduce 1900-2100 (only 100 inside the step)."""
    a, b = _event("ProfilerStep#2", 1, 0, 1000), _event("ProfilerStep#3", 1, 1000, 2000)
    return [
        a, b,
        _event("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", 1, 0, 100, a),
        _event("aten::mm", 1, 100, 600, a),
        _event("aten::addmm", 1, 150, 550),  # a child of aten::mm: time counted once, by its parent
        _event("gloo:all_reduce", 2, 500, 900),
        _event("aten::mm", 1, 1000, 1400, b),
        _event("gloo:all_reduce", 2, 1900, 2100),
        _event("gloo:broadcast", 2, -800, -100),  # before the window (DDP's first broadcast): not counted
    ]


def test_the_summary_splits_each_moment_of_a_step_once():
    from nbtrain.rank.profiling import summarize

    summary = summarize(_two_steps())
    assert summary["steps"] == 2 and summary["step_time"] == pytest.approx(1000e-6)
    assert summary["split"] == pytest.approx({"communication": 250e-6, "data": 50e-6, "compute": 400e-6,
                                              "idle": 300e-6})
    assert sum(summary["split"].values()) == pytest.approx(summary["step_time"])
    assert summary["top"] == [("aten::mm", pytest.approx(450e-6)),
                              ("enumerate(DataLoader)#_SingleProcessDataLoaderIter.__next__", pytest.approx(50e-6))]
    assert summary["collective"] == "gloo:all_reduce"


def test_the_summary_does_not_depend_on_the_order_of_the_events():
    from nbtrain.rank.profiling import summarize

    assert summarize(list(reversed(_two_steps()))) == summarize(_two_steps())


def test_an_operator_counts_only_its_time_inside_the_steps():
    from nbtrain.rank.profiling import _top

    windows = [(1000 * i, 1000 * i + 600) for i in range(100)]  # 100 steps of 600 us, 400 us apart
    events = [_event("gloo:all_reduce", 2, -5000, 200_000),  # spans every step
              _event("gloo:barrier", 2, 1500, 2300)]  # the last 100 us of step 1, the first 300 of step 2
    assert _top(events, list(reversed(windows)), 2) == [("gloo:all_reduce", pytest.approx(600e-6)),
                                                        ("gloo:barrier", pytest.approx(400e-6 / 100))]


def test_a_window_without_steps_says_so():
    from nbtrain.rank.profiling import summarize

    assert summarize([_event("aten::mm", 1, 0, 100)]) == {"steps": 0}


# -- where the time outside operators went: the main thread's samples, from the user's own lines --

HERE = ("/home/u/train.py", 12, "load")
THERE = ("/home/u/train.py", 30, "train")


def test_samples_outside_operators_name_the_users_lines_by_their_share():
    from nbtrain.rank.profiling import frames_outside

    # Two steps, begun at 5,000,000 and 7,000,000 ns by the samples' clock, at 100 and 2,300 us by the
    # profiler's (which runs on its own origin); outside operators: 100-1,100 and 2,300-2,800 us.
    marks, starts, outside = [5_000_000, 7_000_000], [100.0, 2300.0], [(100.0, 1100.0), (2300.0, 2800.0)]
    samples = [(4_000_000, THERE),  # before the window: not counted
               (5_100_000, HERE), (5_500_000, HERE), (5_900_000, None),  # step 1, at 200/600/1,000 us: outside
               (6_500_000, THERE),  # step 1 at 1,600 us: in an operator, which tells it
               (7_200_000, THERE), (7_400_000, HERE)]  # step 2 at 2,500 and 2,700 us: outside
    assert frames_outside(samples, marks, starts, outside) == [(HERE, pytest.approx(3 / 5)),
                                                               (THERE, pytest.approx(1 / 5))]
    assert frames_outside(samples, marks, starts, outside, count=1) == [(HERE, pytest.approx(3 / 5))]
    assert frames_outside([], marks, starts, outside) == []
    assert frames_outside([(6_500_000, THERE)], marks, starts, outside) == []  # nothing outside: nothing said


def test_the_summary_gives_the_users_lines_their_share_of_the_time_outside_operators():
    from nbtrain.rank.profiling import summarize

    # _two_steps: outside operators (idle, data) 0-100, 900-1,000 and 1,400-1,900 us; steps begin at 0 and 1,000 us.
    marks = [10_000_000, 11_000_000]
    samples = [(10_050_000, HERE), (10_950_000, HERE), (11_500_000, THERE), (11_700_000, THERE),
               (11_800_000, THERE), (10_300_000, HERE)]  # the last one in aten::mm: not counted
    summary = summarize(_two_steps(), samples, marks)
    away = summary["split"]["idle"] + summary["split"]["data"]  # 350 us a step
    assert summary["frames"] == [(*THERE, pytest.approx(away * 3 / 5)), (*HERE, pytest.approx(away * 2 / 5))]
    assert summarize(_two_steps())["frames"] == []  # no samples (an older rank): no lines


def test_only_the_users_own_code_is_a_place():
    import json

    from nbtrain.rank.profiling import own_code, user_place

    assert own_code(__file__) and own_code("/tmp/ipykernel_1/123.py") and own_code("<nbtrain cell>")
    assert not own_code(torch.__file__) and not own_code(json.__file__) and not own_code(nbtrain.__file__)
    assert not own_code("<frozen importlib._bootstrap>")
    try:
        json.loads("{")  # raises two frames down, in json/decoder.py
    except ValueError as exc:
        tb = exc.__traceback__
        while tb.tb_next is not None:
            tb = tb.tb_next
        innermost = tb.tb_frame
    assert not own_code(innermost.f_code.co_filename)
    # Past json's two frames, this test's own, at the line it runs now (the frame lives on).
    here = sys._getframe()
    assert user_place(innermost) == (__file__, here.f_lineno, "test_only_the_users_own_code_is_a_place")
    assert user_place(None) is None


def test_the_sampler_sees_a_thread_in_the_users_code_and_stops():
    import threading

    from nbtrain.rank.profiling import StackSampler

    done = threading.Event()

    def wait_until_done():
        while not done.wait(0.001):
            pass

    worker = threading.Thread(target=wait_until_done)
    worker.start()
    sampler = StackSampler(worker.ident)
    sampler.start()
    try:
        while len(sampler.samples) < 3:
            time.sleep(0.005)
    finally:
        sampler.stop()
        done.set()
        worker.join()
    assert not [t for t in threading.enumerate() if t.name == "nbtrain-profile-sampler"]
    places = {place for _, place in sampler.samples}
    assert places == {(__file__, wait_until_done.__code__.co_firstlineno + 1, "wait_until_done")}, places
    times = [at for at, _ in sampler.samples]
    assert times == sorted(times)


def profiled(split, frames=()):
    return {"steps": 2, "step_time": sum(split.values()), "top": [("aten::mm", 0.001)], "collective": "gloo:all_reduce",
            "split": {"communication": 0.0, "data": 0.0, "compute": 0.0, "idle": 0.0, **split}, "frames": list(frames)}


def test_the_table_names_the_users_lines_when_the_step_is_mostly_outside_operators():
    from nbtrain.display.profile import ProfileTable

    lines = [("/home/u/train.py", 12, "load", 0.018), ("/home/u/train.py", 3, "<module>", 0.001)]
    table = ProfileTable({0: profiled({"communication": 0.020, "compute": 0.002}, [(*THERE, 0.0001)]),
                          1: profiled({"data": 0.004, "idle": 0.015, "compute": 0.003}, lines)})
    assert table.frames(1) == [("train.py:12 load()", 0.018), ("train.py:3", 0.001)]
    assert table.frames(0) == []  # mostly waiting in a collective: its operators tell it
    rows = {r[0]: r[-1] for r in table.rows()[1:]}
    assert rows == {"0": "aten::mm 1 ms", "1": "outside operators: train.py:12 load() 18 ms, train.py:3 1 ms"}
    assert table.verdict().startswith("slowest: rank 1, 22 ms per step, 68 % idle (in no operator: Python code, "
                                      "sleeps, I/O), at train.py:12 load(); rank 0 waits for it"), table.verdict()
    older = ProfileTable({0: {k: v for k, v in profiled({"idle": 0.01}).items() if k != "frames"}})
    assert older.frames(0) == [] and older.rows()[1][-1] == "aten::mm 1 ms"  # a summary from before the lines


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the memory snapshot is CUDA's")
def test_a_cuda_rank_saves_its_memory_snapshot(tmp_path, no_leftovers):
    def train():
        ctx = nbtrain.context()
        x = torch.randn(256, 256, device=ctx.device)
        for _ in ctx.progress(range(4)):
            x = torch.tanh(x @ x)

    result = nbtrain.launch(train, devices=1, accelerator="gpu", start="template", progress=False,
                            run_dir=tmp_path, profile=nbtrain.Profile(steps=2), timeout=300)
    (summary,) = result.profile.summaries.values()
    assert summary["memory_snapshot"].endswith("rank0.memory.pickle") and os.path.getsize(summary["memory_snapshot"])


@pytest.mark.slow
def test_live_ranks_profile_and_track_a_call(tmp_path, no_leftovers):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    def steps(n):
        ctx = nbtrain.context()
        for i in ctx.progress(range(n)):
            ctx.all_gather(torch.ones(4))
            ctx.log("loss", 1.0 / (i + 1), sync_dist=True)

    with nbtrain.Ranks(devices=2, accelerator="cpu", progress=False, timeout=120) as ranks:
        result = ranks.profile(steps, 6, profile=nbtrain.Profile(steps=3), trackers="tensorboard", run_dir=tmp_path)
        with pytest.raises(ValueError, match=r"^ranks=\[1\] with trackers or a profile: they run on every rank"):
            ranks.run(steps, 2, ranks=[1], profile=True, run_dir=tmp_path)
        plain = ranks.run(steps, 2)  # the next call has neither
    assert sorted(result.profile.traces()) == [0, 1] and plain.profile is None
    assert all(s["steps"] == 3 for s in result.profile.ranks.values())
    # gloo:all_gather, c10d::allgather_: in the table, or (a busy machine's steps mostly outside
    # operators, where the rows name the user's lines) as each rank's top collective
    collectives = [s.get("collective") for s in result.profile.ranks.values()]
    assert re.search(r"all_?gather", repr(result.profile) + repr(collectives)), (result.profile, collectives)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("loss")] == list(range(6))
