"""nbtrain.sweep on real Optuna (TPE, MedianPruner, enqueued trials, SQLite) and real processes:
slots never over-filled, pruned trials stopped at once, failures recorded, resume, Ctrl-C in a
real kernel, a SLURM placement; and its one-line refusals of bad input."""
import functools
import os
import stat
import time
from pathlib import Path

import optuna
import pytest

import nbtrain
from conftest import CHILDREN
from nbtrain.common.inventory import Gpu, StaticInventory, use_inventory
from nbtrain.common.protocol import Vital
from nbtrain.display.sweep_view import SweepState, TrialRow, summary_html, summary_text
from nbtrain.notebook.many.slots import plan_slots
from nbtrain.notebook.many.sweep import device_memory, objective
from nbtrain.notebook.many.sweep_study import (
    GPU_MEMORY,
    INTERRUPTED,
    KERNEL,
    RETRY_OF,
    TRACEBACK,
    _start_time,
    resume,
    this_kernel,
)
from nbtrain.notebook.run.result import Result

KEEP_THE_TEMPLATE = True  # trials launched from threads start on the template: one for the module (conftest.py)

optuna.logging.set_verbosity(optuna.logging.WARNING)

FLOAT = optuna.distributions.FloatDistribution(0.0, 1.0)
SPACE = {"x": FLOAT}


def quiet_study(**kwargs):
    return optuna.create_study(**kwargs)


# -- bad input: one line, naming the argument and what is accepted; nothing started or written --

def refused(tmp_path, **given) -> str:
    args = {"fn": lambda x: x, "space": SPACE, "trials": 2, "metric": "loss", "devices": 1, "accelerator": "cpu",
            "run_dir": tmp_path / "run", **given}
    with pytest.raises((ValueError, TypeError)) as caught:
        nbtrain.sweep(args.pop("fn"), args.pop("space"), **args)
    message = str(caught.value)
    assert "\n" not in message, message
    assert not (tmp_path / "run").exists()  # refused before the study was made
    return message


@pytest.mark.parametrize("given, expected", [
    ({"space": [FLOAT]}, "space=[FloatDistribution"),
    ({"space": {}}, "give a dict mapping parameter names to Optuna distributions"),
    ({"space": {"x": [0.1, 0.2]}}, "space['x']=[0.1, 0.2]: give an Optuna distribution"),
    ({"space": {"not a name": FLOAT}}, "space key 'not a name'"),
    ({"trials": 0}, "trials=0: give a whole number, 1 or more."),
    ({"trials": 2.5}, "trials=2.5"),
    ({"metric": ""}, "metric='': give the name fn logs with ctx.log"),
    ({"direction": "down"}, "direction='down': give 'minimize' or 'maximize'."),
    ({"devices": 2, "devices_per_trial": 3}, "devices_per_trial=3: more than the 2 CPU processes that devices=2 gives"),
    ({"devices_per_trial": 0}, "devices_per_trial=0: give a whole number"),
    ({"trials_per_device": 0}, "trials_per_device=0: give a whole number"),
    ({"trials_per_device": 2}, "trials_per_device=2: several trials share a GPU, and these are CPU processes"),
    ({"catch": "ValueError"}, "catch='ValueError': give an exception class"),
    ({"sampler": "tpe"}, "sampler='tpe': give an Optuna sampler"),
    ({"pruner": 3}, "pruner=3: give an Optuna pruner"),
    ({"study": 42}, "study=42: give an optuna.Study, a storage URL"),
    ({"stop_after": -1}, "stop_after=-1: give a positive number of seconds"),
    ({"stop_after": 5, "timeout": 5}, "timeout= is the earlier name of stop_after=; give stop_after= alone."),
    ({"progress": "loud"}, "progress='loud'"),
    ({"strategy": "dp"}, "strategy='dp': runs in slots take 'auto'"),
    ({"fn": 3}, "sweep(fn=...) needs a callable"),
])
def test_bad_input_is_refused_in_one_line(tmp_path, given, expected):
    assert expected in refused(tmp_path, **given)


def test_metric_is_required_unless_fn_takes_a_trial():
    with pytest.raises(ValueError, match="^metric=None: sweep"):
        nbtrain.sweep(lambda x: x, SPACE, trials=1)
    with pytest.raises(ValueError, match=r"^sweep\(lambda\(lr, width\)\): with no space=, fn is called as Optuna"):
        nbtrain.sweep(lambda lr, width: lr, trials=1)
    with pytest.raises(ValueError, match=r"^sweep\(lambda\) with cluster=: a trial on a cluster cannot yet ask"):
        nbtrain.sweep(lambda trial: 0.5, trials=1, devices=1, cluster=nbtrain.Slurm())


def test_a_given_study_keeps_its_own_sampler_and_direction(tmp_path):
    study = quiet_study(direction="maximize")
    assert "sampler=" in refused(tmp_path, study=study, sampler=optuna.samplers.RandomSampler())
    assert "direction='minimize', but the study" in refused(tmp_path, study=study, direction="minimize")


def test_slots_pack_onto_the_gpus_given():
    use_inventory(StaticInventory([Gpu(i, "H100", f"GPU-{i}", f"0000:{i:02x}:00.0") for i in range(8)]))
    try:
        ones, _ = plan_slots("auto", 1, "gpu")
        twos, _ = plan_slots("auto", 2, "gpu")
        odd, note = plan_slots([1, 2, 5], 2, "gpu")
        shared, _ = plan_slots([0, 1], 1, "gpu", per_device=3)
        with pytest.raises(ValueError, match="^trials_per_device=2 with devices_per_trial=2: trials that share a GPU"):
            plan_slots("auto", 2, "gpu", per_device=2)
    finally:
        use_inventory(None)
    assert [s.devices for s in ones] == [(i,) for i in range(8)]
    assert [s.devices for s in twos] == [(0, 1), (2, 3), (4, 5), (6, 7)] and str(twos[1]) == "GPUs 2,3"
    assert [s.devices for s in odd] == [(1, 2)] and note.startswith("GPU [5] left idle")
    assert [s.devices for s in shared] == [(0,)] * 3 + [(1,)] * 3 and str(shared[4]) == "GPU 1 (slot 4)"
    # Each shared slot a one-GPU launch (or warm process, keyed by its index) of its own, on its GPU.
    assert [s.launch_devices for s in shared] == [[0]] * 3 + [[1]] * 3 and [s.index for s in shared] == list(range(6))
    assert {(s.size, s.sharing) for s in shared} == {(1, 3)} and {s.sharing for s in ones} == {1}
    assert {s.threads for s in shared} == {max(1, len(os.sched_getaffinity(0)) // 6)}


def test_cpu_slots():
    slots, note = plan_slots(4, 2, "cpu")
    assert [(s.launch_devices, str(s)) for s in slots] == [(2, "CPU slot 0 (2 ranks)"), (2, "CPU slot 1 (2 ranks)")]
    assert note is None


def test_a_trials_value_is_its_last_logged_metric_else_a_returned_number():
    from nbtrain.common.protocol import Metric
    from nbtrain.notebook.run.result import Result

    logged = Result(None, [None], [Metric(0, 0, "loss", 2.0, False), Metric(1, 1, "loss", 9.0, False),
                                   Metric(1, 0, "loss", 1.5, False)], 0.0)
    assert objective(logged, "loss") == 1.5
    assert objective(Result(0.25, [0.25], [], 0.0), "loss") == 0.25
    assert objective(Result({"model": 1}, [], [], 0.0), "loss") is None


def test_resume_fails_a_dead_kernels_trials_and_runs_them_again_once():
    study = quiet_study()
    done = study.ask({"x": FLOAT})
    study.tell(done, 0.5)
    dead = study.ask({"x": FLOAT})
    dead.set_user_attr(KERNEL, f"{os.uname().nodename}:{2**22 + 12345}")  # no such pid
    alive = study.ask({"x": FLOAT})
    alive.set_user_attr(KERNEL, f"{os.uname().nodename}:1")  # init: a live kernel elsewhere
    assert resume(optuna, study) == 1
    assert resume(optuna, study) == 1  # enqueued once, however often resumed
    states = {t.number: (t.state.name, t.user_attrs) for t in study.get_trials()}
    assert states[dead.number][0] == "FAIL" and states[dead.number][1][INTERRUPTED] is True
    assert states[alive.number][0] == "RUNNING"
    waiting = [t for t in study.get_trials() if t.state.name == "WAITING"]
    assert [(t.system_attrs["fixed_params"], t.user_attrs[RETRY_OF]) for t in waiting] == [(dead.params, dead.number)]


def test_the_summarys_picture_has_a_slice_of_the_most_important_parameter():
    pytest.importorskip("matplotlib", reason="the summary's picture is drawn with matplotlib")
    from nbtrain.display.sweep_view import curves_bundle, curves_figure

    state = SweepState("sweep of train", "loss", "minimize", "2 CPU slots", target=3)
    state.rows = {n: TrialRow(n, {"lr": lr, "width": 8}, "CPU slot 0", "complete", value) for n, lr, value in
                  ((0, 0.001, 0.9), (1, 0.01, 0.5), (2, 0.3, 0.7))}
    for row in state.rows.values():
        row.curve.add(0, row.value)
    state.best, state.importances = (1, 0.5, {"lr": 0.01, "width": 8}), {"lr": 0.9, "width": 0.1}
    titles = [ax.get_title(loc="left") for ax in curves_figure(state).axes]
    assert titles == ["loss per trial (dashed: pruned)", "loss by lr (most important)"]
    assert "image/png" in curves_bundle(state)
    state.importances = None
    assert len(curves_figure(state).axes) == 1


def test_a_warm_trial_reads_only_builtins_so_its_rank_asks_the_notebook_for_nothing():
    """A name the trial's code reads that the live rank lacks is asked of the notebook, a round trip
    at every trial (an attribute, `.unpack_job`, counts as such a name)."""
    import builtins

    from nbtrain.common.pickling_parts import code_global_names
    from nbtrain.notebook.many.sweep_workers import TRIAL

    assert code_global_names(TRIAL.__code__) <= set(dir(builtins)), code_global_names(TRIAL.__code__)


class ArrivesInRanks:
    """What an objective carries (a dataset): each unpickling, in a rank, leaves a file."""

    def __init__(self, directory: str):
        self.directory = directory

    def __reduce__(self):
        return arrived, (self.directory,)


def arrived(directory: str) -> ArrivesInRanks:
    Path(directory, f"{os.getpid()}-{time.monotonic_ns()}").touch()
    return ArrivesInRanks(directory)


def reads_its_data(data: ArrivesInRanks, trial):
    return trial.suggest_float("x", 0.0, 1.0) + len(data.directory) * 0


@pytest.mark.slow
def test_the_objective_and_what_it_carries_reach_each_warm_process_once(tmp_path, no_leftovers):
    swept = nbtrain.sweep(functools.partial(reads_its_data, ArrivesInRanks(str(tmp_path))), trials=6, devices=2,
                          accelerator="cpu", study=quiet_study(), progress=False)
    assert [t.state.name for t in swept.study.get_trials()] == ["COMPLETE"] * 6
    arrivals = [name.split("-")[0] for name in os.listdir(tmp_path)]
    assert len(arrivals) == len(set(arrivals)) == 2, arrivals  # once per slot's process, not once per trial


def test_a_warm_rank_keeps_its_sweeps_function_and_asks_for_it_when_it_has_none():
    import dill

    from nbtrain.rank.trial import FUNCTION_WANTED, TrialSpec, run_trial

    assert run_trial(TrialSpec(None, 0, {"x": 1}, {}, sweep="never-sent-here")) is FUNCTION_WANTED  # a fresh process
    assert run_trial(TrialSpec(lambda x: x * 2, 1, {"x": 1}, {}, sweep="this-sweep")) == 2  # kept...
    assert run_trial(TrialSpec(None, 2, {"x": 3}, {}, sweep="this-sweep")) == 6  # ... for the next trials
    assert run_trial(TrialSpec(None, 3, {"x": 3}, {}, sweep="an-earlier-sweep")) is FUNCTION_WANTED
    assert dill.loads(dill.dumps(FUNCTION_WANTED)) is FUNCTION_WANTED  # one object, in the rank and the notebook


def deaf_when_pruned(marks: str, x: float):
    """Reports x; pruned (x > 0.5), it goes on for 3 s, deaf to the interrupt: its process is replaced."""
    Path(marks, f"{x}-{os.getpid()}").touch()
    nbtrain.context().log("loss", x, step=0)
    if x > 0.5:
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            try:
                time.sleep(0.05)
            except KeyboardInterrupt:
                pass
    return x


@pytest.mark.slow
def test_a_slot_whose_process_was_replaced_sends_it_the_objective_again(tmp_path, no_leftovers):
    study = quiet_study(pruner=optuna.pruners.ThresholdPruner(upper=0.5))
    for x in (0.2, 0.9, 0.1):  # the first leaves its process the objective; the second, pruned, outlives it
        study.enqueue_trial({"x": x})
    swept = nbtrain.sweep(functools.partial(deaf_when_pruned, str(tmp_path)), SPACE, trials=3, metric="loss",
                          devices=1, accelerator="cpu", study=study, progress=False)
    assert [t.state.name for t in study.get_trials()] == ["COMPLETE", "PRUNED", "COMPLETE"] and swept.best_value == 0.1
    pids = {float(x): pid for x, pid in (name.split("-") for name in os.listdir(tmp_path))}
    assert pids[0.2] == pids[0.9] != pids[0.1]  # the third trial, in a fresh process that asked for the objective


def test_a_trials_device_memory_is_the_most_its_first_rank_held():
    def vital(rank, gpu_memory):
        return Vital(0.0, rank, None, 1 << 20, gpu_memory, None if gpu_memory is None else 50, 0)

    def result(*vitals):
        return Result(None, [None], [], 1.0, vitals=list(vitals))

    assert device_memory(result(vital(0, 3 << 30), vital(1, 9 << 30), vital(0, 5 << 30), vital(0, 4 << 30))) == 5 << 30
    assert device_memory(result(vital(0, None), vital(0, None))) is None  # a CPU trial: RSS only
    assert device_memory(result()) is None  # over before the first sample


def test_the_summary_says_what_each_line_and_step_is():
    pytest.importorskip("matplotlib", reason="the summary's picture is drawn with matplotlib")
    from nbtrain.display.sweep_view import curves_figure

    state = SweepState("sweep of train", "loss", "minimize", "2 CPU slots", target=3)
    state.rows = {0: TrialRow(0, {"lr": 0.1}, "CPU slot 0", "complete", 0.5, 2, progress="epoch 3/3"),
                  1: TrialRow(1, {"lr": 0.3}, "CPU slot 1", "pruned", 2.0, 1, detail="pruned at step 1")}
    for row in state.rows.values():
        row.curve.add(0, row.value)
    state.best = (0, 0.5, {"lr": 0.1})
    legend = curves_figure(state).axes[0].get_legend()
    assert [t.get_text() for t in legend.get_texts()] == ["trial 0 (best)", "other trials", "pruned"]
    assert "<th style='text-align:left'>at step</th>" in summary_html(state, "finished")  # the logged step, beside 3/3


def test_an_objectives_key_is_its_code_and_space():
    def key(fn, space=None):
        from nbtrain.notebook.many.sweep_study import objective_key

        return objective_key(fn, space)

    first = lambda trial: trial.suggest_float("x", 0, 1)  # noqa: E731
    again = lambda trial: trial.suggest_float("x", 0, 1)  # noqa: E731 - the same code elsewhere: the same objective
    other = lambda trial: trial.suggest_float("x", 0, 2)  # noqa: E731
    assert key(first) == key(again) != key(other)
    assert key(first) != key(first, SPACE)
    assert key(functools.partial(timed, "/a")) == key(functools.partial(timed, "/b"))  # bound arguments left out
    assert key(lambda trial: [i for i in range(3)]) == key(lambda trial: [i for i in range(3)])  # nested code too


def test_summary_names_the_best_and_every_trial():
    state = SweepState("sweep of train", "loss", "minimize", "2 CPU slots", target=3)
    state.rows = {0: TrialRow(0, {"lr": 0.1}, "CPU slot 0", "complete", 0.5, 9),
                  1: TrialRow(1, {"lr": 0.3}, "CPU slot 1", "pruned", 2.0, 1, detail="pruned at step 1"),
                  2: TrialRow(2, {"lr": 0.9}, "CPU slot 0", "failed", None, None, detail="rank 0 failed: ValueError: x")}
    state.best = (0, 0.5, {"lr": 0.1})
    state.importances = {"lr": 0.875}
    text = summary_text(state, "finished")
    assert text.splitlines()[-1] == "parameter importances (Optuna's get_param_importances): lr 0.88"
    assert text.splitlines()[0].endswith("3 trials here (1 complete, 1 failed, 1 pruned) of 3; best: trial 0, loss=0.5 (lr=0.1)")
    assert "trial 1  pruned  lr=0.3  loss=2 @ step 1" in text and "rank 0 failed: ValueError: x" in text
    html = summary_html(state, "finished")
    assert "<b>nbtrain</b>" in html and "<th style='text-align:left'>lr</th>" in html and "font-weight:bold" in html


# -- real trials ------------------------------------------------------------------------------

def mark(directory: str, name: str) -> None:
    Path(directory, name).write_text(f"{time.time()!r}")


def timed(marks: str, x: float, seconds: float = 0.4):
    """A trial that says when it ran, by files the test reads (a pruned trial leaves no end)."""
    number = f"{x:.6f}"
    mark(marks, f"{number}.start")
    Path(marks, f"{number}.pid").write_text(str(os.getpid()))
    ctx = nbtrain.context()
    for step in range(4):
        time.sleep(seconds / 4)
        ctx.log("loss", x + 1.0 / (step + 1), step=step)
    mark(marks, f"{number}.end")
    return {"x": x, "pid": os.getpid()}


def spans(marks: Path) -> list[tuple[float, float]]:
    found = []
    for start in marks.glob("*.start"):
        end = start.with_suffix(".end")
        found.append((float(start.read_text()), float(end.read_text()) if end.exists() else float("inf")))
    return found


def most_at_once(found: list[tuple[float, float]]) -> int:
    events = sorted([(s, 1) for s, _ in found] + [(e, -1) for _, e in found], key=lambda e: (e[0], e[1]))
    running = peak = 0
    for _, change in events:
        running += change
        peak = max(peak, running)
    return peak


@pytest.mark.slow
def test_trials_never_outnumber_the_slots_and_the_best_result_comes_back(tmp_path, no_leftovers):
    marks = tmp_path / "marks"
    marks.mkdir()
    study = quiet_study(sampler=optuna.samplers.TPESampler(seed=1, n_startup_trials=3), pruner=optuna.pruners.NopPruner())
    result = nbtrain.sweep(functools.partial(timed, str(marks)), SPACE, trials=7, metric="loss", devices=2,
                           accelerator="cpu", study=study, progress=False)
    found = spans(marks)
    assert len(found) == 7 and all(e < float("inf") for _, e in found)
    assert most_at_once(found) <= 2
    assert len({p.read_text() for p in marks.glob("*.pid")}) == 2  # a process per slot, warm from trial to trial
    trials = study.get_trials()
    assert {t.state.name for t in trials} == {"COMPLETE"} and len(trials) == 7
    assert {t.user_attrs["nbtrain_slot"] for t in trials} == {"CPU slot 0", "CPU slot 1"}
    assert result.best_value == min(t.value for t in trials)
    assert result.best_result.value["x"] == result.best_params["x"]  # fn's return value, in the notebook
    assert result.best_result.value["pid"] != os.getpid()  # ran in a process of its own
    assert len(result.best_result.metrics("loss")) == 4
    assert len(result.dataframe()) == 7


def pruned_unless_first(marks: str, x: float):
    """Enqueued x=0.1 and 0.2 finish; worse ones are pruned by the median of those, at step 1."""
    mark(marks, f"{x:.6f}.start")
    ctx = nbtrain.context()
    for step in range(60):  # 30 s unless pruned
        ctx.log("loss", x, step=step)
        time.sleep(0.5 if x > 0.5 else 0.01)
    mark(marks, f"{x:.6f}.end")
    return x


@pytest.mark.slow
def test_a_pruned_trial_ends_at_once_and_frees_its_slot(tmp_path, no_leftovers):
    marks = tmp_path / "marks"
    marks.mkdir()
    study = quiet_study(pruner=optuna.pruners.MedianPruner(n_startup_trials=2, n_warmup_steps=1))
    for x in (0.1, 0.2, 0.9, 0.8, 0.7):
        study.enqueue_trial({"x": x})
    nbtrain.sweep(functools.partial(pruned_unless_first, str(marks)), SPACE, trials=5, metric="loss", devices=1,
                  accelerator="cpu", study=study, progress=False)
    states = {round(t.params["x"], 1): t.state.name for t in study.get_trials()}
    assert states == {0.1: "COMPLETE", 0.2: "COMPLETE", 0.9: "PRUNED", 0.8: "PRUNED", 0.7: "PRUNED"}
    # One slot: each pruned trial's successor started, and none of the pruned reached its end.
    assert sorted(p.name for p in marks.iterdir()) == sorted(
        [f"{x:.6f}.start" for x in (0.1, 0.2, 0.9, 0.8, 0.7)] + [f"{x:.6f}.end" for x in (0.1, 0.2)])


def fails_on_big(x: float):
    ctx = nbtrain.context()
    ctx.log("loss", x)
    if x > 0.5:
        raise ValueError(f"x={x} is too big")
    return x


@pytest.mark.slow
def test_a_failing_trial_is_recorded_with_its_traceback_and_the_sweep_goes_on(tmp_path, no_leftovers):
    study = quiet_study()
    for x in (0.9, 0.1, 0.8, 0.2):
        study.enqueue_trial({"x": x})
    result = nbtrain.sweep(fails_on_big, SPACE, trials=4, metric="loss", devices=2, accelerator="cpu", study=study,
                           progress="text")
    failed = [t for t in study.get_trials() if t.state.name == "FAIL"]
    assert sorted(t.params["x"] for t in failed) == [0.8, 0.9]
    assert all('raise ValueError(f"x={x} is too big")' in t.user_attrs[TRACEBACK] for t in failed)
    assert result.best_params == {"x": 0.1}
    with pytest.raises(nbtrain.WorkerError, match="too big") as caught:  # catch=(): the first failure stops it
        nbtrain.sweep(fails_on_big, SPACE, trials=1, metric="loss", devices=1, accelerator="cpu", progress=False,
                      study=quiet_study(sampler=optuna.samplers.RandomSampler(seed=0)), catch=())
    assert isinstance(caught.value, ValueError)  # the rank's own exception class, as launch gives it


def constant(x: float):
    nbtrain.context().log("loss", x)
    return x


@pytest.mark.slow
def test_the_sqlite_study_in_run_dir_resumes(tmp_path, no_leftovers):
    run_dir = tmp_path / "sweep"
    first = nbtrain.sweep(constant, SPACE, trials=3, metric="loss", devices=2, accelerator="cpu", run_dir=run_dir,
                          sampler=optuna.samplers.RandomSampler(seed=0), progress=False)
    assert stat.S_IMODE(os.stat(run_dir).st_mode) == 0o700
    assert stat.S_IMODE(os.stat(run_dir / "study.db").st_mode) == 0o600
    before = [(t.number, t.params) for t in first.study.get_trials()]
    # Run again with nothing left to run: the best trial ran in this kernel, its Result is kept.
    same = nbtrain.sweep(constant, SPACE, trials=3, metric="loss", devices=2, accelerator="cpu", run_dir=run_dir,
                         progress=False)
    assert same.best_result is not None and same.best_result.value == first.best_value
    again = nbtrain.sweep(constant, SPACE, trials=5, metric="loss", devices=2, accelerator="cpu", run_dir=run_dir,
                          progress=False)
    trials = again.study.get_trials()
    assert [(t.number, t.params) for t in trials][:3] == before and len(trials) == 5
    assert all(t.state.name == "COMPLETE" for t in trials)
    assert all(list(t.intermediate_values) == [0] for t in trials)  # each trial's steps from 0, in a warm process too
    assert again.best_result is not None and again.best_result.value == again.best_value  # whichever sweep ran it
    with pytest.raises(ValueError, match="optimises 'loss'"):
        nbtrain.sweep(constant, SPACE, trials=5, metric="accuracy", devices=1, accelerator="cpu", run_dir=run_dir)


def two_ranks(x: float):
    ctx = nbtrain.context()
    mean = ctx.log("loss", x + ctx.rank, sync_dist=True)  # a collective: both ranks are one world
    return ctx.world_size, mean, os.environ["MASTER_PORT"]


@pytest.mark.slow
def test_a_slot_of_two_devices_is_a_ddp_launch_of_its_own(no_leftovers):
    study = quiet_study()
    for x in (0.2, 0.6):
        study.enqueue_trial({"x": x})
    result = nbtrain.sweep(two_ranks, SPACE, trials=2, metric="loss", devices=2, devices_per_trial=2,
                           accelerator="cpu", study=study, progress=False)
    assert sorted(t.value for t in study.get_trials()) == pytest.approx([0.7, 1.1])  # the mean over the two ranks
    values = result.best_result.values
    assert [v[0] for v in values] == [2, 2] and [v[1] for v in values] == pytest.approx([0.7, 0.7])
    assert values[0][2] == values[1][2]  # one rendezvous for the trial's two ranks


@pytest.mark.slow
def test_trials_on_slurm(slurm, tmp_path, no_leftovers):
    study = quiet_study()
    for x in (0.3, 0.6):
        study.enqueue_trial({"x": x})
    result = nbtrain.sweep(constant, SPACE, trials=2, metric="loss", devices=2, accelerator="cpu", study=study,
                           cluster=nbtrain.Slurm(), progress=False)
    assert sorted(t.value for t in study.get_trials()) == [0.3, 0.6]
    assert result.best_result.value == 0.3
    assert slurm.jobs() == []


# -- Optuna's own objective(trial), unchanged -------------------------------------------------

def define_model(trial):
    """optuna-examples pytorch_simple's, on 16 features and 4 classes."""
    import torch.nn as nn

    n_layers = trial.suggest_int("n_layers", 1, 3)
    layers, in_features = [], 16
    for i in range(n_layers):
        out_features = trial.suggest_int(f"n_units_l{i}", 4, 32)
        layers += [nn.Linear(in_features, out_features), nn.ReLU(),
                   nn.Dropout(trial.suggest_float(f"dropout_l{i}", 0.2, 0.5))]
        in_features = out_features
    return nn.Sequential(*layers, nn.Linear(in_features, 4), nn.LogSoftmax(dim=1))


def optuna_objective(trial):
    """pytorch_simple's objective as written, on a tiny synthetic set instead of FashionMNIST."""
    import torch
    import torch.nn.functional as F

    torch.manual_seed(0)
    model = define_model(trial)
    optimizer_name = trial.suggest_categorical("optimizer", ["Adam", "RMSprop", "SGD"])
    lr = trial.suggest_float("lr", 1e-5, 1e-1, log=True)
    optimizer = getattr(torch.optim, optimizer_name)(model.parameters(), lr=lr)
    x = torch.randn(128, 16)
    y = x[:, :4].argmax(1)
    for epoch in range(3):
        model.train()
        for i in range(0, 128, 32):
            optimizer.zero_grad()
            F.nll_loss(model(x[i:i + 32]), y[i:i + 32]).backward()
            optimizer.step()
        model.eval()
        with torch.no_grad():
            accuracy = (model(x).argmax(1) == y).float().mean().item()
        trial.report(accuracy, epoch)
        if trial.should_prune():
            raise optuna.exceptions.TrialPruned()
    trial.set_user_attr("threads", torch.get_num_threads())
    trial.set_user_attr("cores", sorted(os.sched_getaffinity(0)))
    return accuracy


def used(params: dict) -> set:
    """The parameters a pytorch_simple trial asks for, given how many layers it drew."""
    return {"n_layers", "optimizer", "lr"} | {f"{p}_l{i}" for i in range(params["n_layers"])
                                               for p in ("n_units", "dropout")}


@pytest.mark.slow
def test_optunas_own_objective_runs_unchanged_define_by_run(no_leftovers):
    study = quiet_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=3),
                        pruner=optuna.pruners.NopPruner())
    for layers in (1, 3):
        study.enqueue_trial({"n_layers": layers})
    swept = nbtrain.sweep(optuna_objective, trials=4, devices=2, accelerator="cpu", study=study, progress=False)
    trials = study.get_trials()
    assert [t.state.name for t in trials] == ["COMPLETE"] * 4
    assert {t.params["n_layers"] for t in trials} >= {1, 3}
    assert all(set(t.params) == used(t.params) for t in trials)  # conditional: only what the trial asked for
    assert all(sorted(t.intermediate_values) == [0, 1, 2] for t in trials)  # trial.report, from the rank
    assert all(t.value == t.intermediate_values[2] for t in trials)  # the returned value is the trial's
    assert all(t.user_attrs["threads"] == max(1, (os.cpu_count() or 1) // 2) for t in trials)  # each slot's share
    assert not any(GPU_MEMORY in t.user_attrs for t in trials)  # CPU trials: no GPU memory said
    cores = {t.user_attrs["nbtrain_slot"]: tuple(t.user_attrs["cores"]) for t in trials}
    if len(os.sched_getaffinity(0)) >= 2:  # a core (or more) of its own for each of the 2 slots
        assert len(set(cores.values())) == 2 and not set(cores["CPU slot 0"]) & set(cores["CPU slot 1"])
    assert swept.best_params == swept.best_trial.params and set(swept.best_params) == used(swept.best_params)
    assert swept.best_value == max(t.value for t in trials) and swept.metric == "value"
    assert swept.best_result.value == swept.best_value
    assert "n_layers" in swept.state.importances and set(swept.state.importances) <= set().union(*(t.params for t in trials))
    assert sum(swept.state.importances.values()) == pytest.approx(1.0)
    assert repr(swept).splitlines()[-1].startswith("parameter importances (Optuna's get_param_importances): ")


def pruned_or_failing(trial):
    x = trial.suggest_float("x", 0.0, 1.0)
    if x > 0.8:
        raise ValueError(f"x={x} is too big")
    for step in range(3):
        trial.report(x, step)
        if trial.should_prune():
            raise optuna.TrialPruned()
    return x if x < 0.3 else float("nan")


@pytest.mark.slow
def test_an_objectives_pruning_failures_and_nan_are_the_trials_states(tmp_path, no_leftovers):
    study = quiet_study(pruner=optuna.pruners.ThresholdPruner(upper=0.5))
    for x in (0.1, 0.9, 0.6, 0.4, 0.2):
        study.enqueue_trial({"x": x})
    swept = nbtrain.sweep(pruned_or_failing, trials=5, devices=2, accelerator="cpu", study=study, progress=False)
    states = {t.params["x"]: (t.state.name, t.user_attrs.get("nbtrain_error", "")) for t in study.get_trials()}
    assert states[0.1] == ("COMPLETE", "") and states[0.2] == ("COMPLETE", "")
    assert states[0.9][0] == "FAIL" and "ValueError: x=0.9 is too big" in states[0.9][1]
    assert states[0.6] == ("PRUNED", "")
    assert states[0.4][0] == "FAIL" and "its value is nan" in states[0.4][1]
    assert swept.best_params == {"x": 0.1} and swept.verdict == "finished"
    # No trial complete: said, and best_value says why instead of Optuna's "Record does not exist".
    nan_only = quiet_study()
    nan_only.enqueue_trial({"x": 0.4})
    swept = nbtrain.sweep(pruned_or_failing, trials=1, devices=1, accelerator="cpu", study=nan_only, progress=False)
    assert swept.verdict.startswith("ended with no complete trial (1 failed: its value is nan")
    assert repr(swept).splitlines()[0].startswith("nbtrain sweep of pruned_or_failing on 1 CPU slot: ended with no")
    with pytest.raises(ValueError, match="no trial of the study 'no-name-[^']*' is complete \\(ended with no complete trial"):
        print(swept.best_value)
    assert swept.best_result is None
    # Every trial failed: the sweep raises the first trial's error.
    failing = quiet_study()
    failing.enqueue_trial({"x": 0.9})
    with pytest.raises(nbtrain.WorkerError, match="too big"):
        nbtrain.sweep(pruned_or_failing, trials=1, devices=1, accelerator="cpu", study=failing, progress=False)
    # stop_after over before the first trial could start; `timeout=`, its earlier name, still works, saying so.
    with pytest.warns(DeprecationWarning, match="sweep\\(timeout=...\\) is now stop_after="):
        swept = nbtrain.sweep(pruned_or_failing, trials=2, devices=1, accelerator="cpu", study=quiet_study(),
                              timeout=1e-9, progress=False)
    assert swept.verdict == "ended with no complete trial (stop_after passed before the first trial could start)"


@pytest.mark.slow
def test_the_default_study_belongs_to_its_objective(tmp_path, monkeypatch, capfd, no_leftovers):
    monkeypatch.chdir(tmp_path)
    optuna.logging.set_verbosity(optuna.logging.INFO)  # Optuna's own "A new study created" would show
    try:
        first = nbtrain.sweep(lambda trial: trial.suggest_float("x", 0, 1), trials=1, devices=1, accelerator="cpu",
                              progress=False)
        other = nbtrain.sweep(lambda trial: trial.suggest_float("x", 0, 1) + 1, trials=1, devices=1,
                              accelerator="cpu", progress=False)
    finally:
        optuna.logging.set_verbosity(optuna.logging.WARNING)
    assert first.study.study_name == "lambda" and first.run_dir != other.run_dir  # another objective, another study
    assert Path(first.run_dir).parent == tmp_path / "nbtrain-runs" and Path(first.run_dir).name.startswith("sweep-lambda-")
    assert other.best_value >= 1 and len(other.study.get_trials()) == 1
    out, err = capfd.readouterr()
    assert "resuming" not in out and "A new study created" not in out + err and "matplotlib" not in out + err
    # The same objective again: resumed, and said before anything runs; edited, said too.
    once = nbtrain.sweep(halved, trials=1, devices=1, accelerator="cpu", progress=False)
    capfd.readouterr()
    nbtrain.sweep(halved, trials=2, devices=1, accelerator="cpu", progress=False)
    out, _ = capfd.readouterr()
    assert out.splitlines()[0] == f"nbtrain: resuming the study 'halved' in {once.run_dir}: 1 trial (1 complete)."

    def edit():
        def halved(trial):  # edited in the notebook: the same name, other code
            return 1.0
        return halved

    edited = edit()
    assert nbtrain.sweep(edited, trials=1, devices=1, accelerator="cpu", progress=False).run_dir != once.run_dir
    capfd.readouterr()
    nbtrain.sweep(edited, trials=3, devices=1, accelerator="cpu", run_dir=once.run_dir, progress=False)
    out, _ = capfd.readouterr()
    assert out.splitlines()[0] == (f"nbtrain: resuming the study 'halved' in {once.run_dir}: 2 trials (2 complete). Its "
                                   "trials were run by another objective (other code or space): give another run_dir "
                                   "for a new study.")


def halved(trial):
    return trial.suggest_float("x", 0, 1) / 2


HOLD = '''
import sys, time, optuna
from nbtrain.notebook.many.sweep_study import open_study
opened = open_study(optuna, None, eval("lambda trial: 0"), space=None, direction=None, sampler=None, pruner=None,
                    metric=None, run_dir=sys.argv[1])
print("held", flush=True)
time.sleep(120)
'''


@pytest.mark.slow
def test_a_second_sweep_of_a_running_study_is_refused_until_the_first_is_gone(tmp_path, no_leftovers):
    import subprocess
    import sys

    run_dir = tmp_path / "sweep"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(run_dir)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "held\n"
        with pytest.raises(RuntimeError, match=f"another sweep of this study is running \\(kernel [^)]*:{holder.pid}\\)"):
            nbtrain.sweep(lambda trial: 0.5, trials=1, devices=1, accelerator="cpu", run_dir=run_dir, progress=False)
    finally:
        holder.kill()
        holder.wait()
        holder.stdout.close()
    # Its kernel gone, the lock went with it.
    swept = nbtrain.sweep(lambda trial: 0.5, trials=1, devices=1, accelerator="cpu", run_dir=run_dir, progress=False)
    assert swept.best_value == 0.5


def test_a_trials_owner_is_its_pid_and_start_time():
    study = quiet_study()
    reused = study.ask({"x": FLOAT})
    reused.set_user_attr(KERNEL, f"{os.uname().nodename}:{os.getppid()}:12345.0")  # alive, but started later
    live = study.ask({"x": FLOAT})
    live.set_user_attr(KERNEL, this_kernel().replace(f":{os.getpid()}:", ":1:").rsplit(":", 1)[0]
                       + f":{_start_time(1)}")  # init, as it is
    resume(optuna, study)
    states = {t.number: t.state.name for t in study.get_trials()}
    assert states[reused.number] == "FAIL" and states[live.number] == "RUNNING"


FULL_DISK = '''
import resource, sys, tempfile, optuna, nbtrain
import nbtrain.notebook.many.sweep, optuna.storages, sqlalchemy.pool
tempfile.gettempdir()  # what imports need, before the limit
resource.setrlimit(resource.RLIMIT_FSIZE, (0, resource.RLIM_INFINITY))  # any write past 0 bytes fails (EFBIG)
nbtrain.sweep(lambda trial: 0, trials=1, devices=1, accelerator="cpu", run_dir=sys.argv[1], progress=False)
'''


@pytest.mark.slow
def test_a_full_disk_is_said_in_words_and_leaves_no_empty_study(tmp_path):
    import subprocess
    import sys

    run_dir = tmp_path / "sweep"
    done = subprocess.run([sys.executable, "-c", FULL_DISK, str(run_dir)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"RuntimeError: run_dir={str(run_dir)!r}: the sweep's study cannot be written there: the "
                           "disk is full"), done.stderr
    assert "SELECT" not in done.stderr and "INSERT" not in done.stderr and "sqlalchemy" not in done.stderr.lower()
    assert not (run_dir / "study.db").exists()


def banner(trial):
    import sys

    print("SomeLibrary: GPU available: False, used: False", file=sys.stderr, flush=True)
    print(f"trial {trial.number} warns on its own", file=sys.stderr, flush=True)
    return 0.5


@pytest.mark.slow
def test_a_librarys_banner_shows_once_per_sweep_not_per_trial(capfd, no_leftovers):
    nbtrain.sweep(banner, trials=3, devices=1, accelerator="cpu", study=quiet_study(), progress="text")
    out, err = capfd.readouterr()
    assert err.count("SomeLibrary: GPU available: False, used: False") == 1, err
    assert all(f"trial {n} warns on its own" in err for n in range(3))
    assert "nbtrain: 2 lines that trials wrote to stderr as an earlier trial had (a library's banner, a warning) " \
           "shown once" in out


SETUP = '''
import os, time, json, optuna, nbtrain
optuna.logging.set_verbosity(optuna.logging.WARNING)

def slow(x):
    ctx = nbtrain.context()
    for step in range(600):
        ctx.log("loss", x, step=step)
        if step == 2:
            open(os.path.join(MARKS, str(x)), "w").close()  # running, and reported to its trial
        time.sleep(0.1)
    return x
''' + CHILDREN


@pytest.mark.slow
def test_ctrl_c_in_a_kernel_stops_every_trial_and_the_cell_again_resumes(kernel, tmp_path):
    _, _, error, _ = kernel.run(SETUP)
    assert error is None, error
    run_dir, marks = tmp_path / "sweep", tmp_path / "marks"
    marks.mkdir()
    kernel.run(f"MARKS = {str(marks)!r}")
    kernel.client.execute(f"nbtrain.sweep(slow, {{'x': optuna.distributions.FloatDistribution(0, 1)}}, trials=4, "
                          f"metric='loss', devices=2, accelerator='cpu', run_dir={str(run_dir)!r}, progress=False)")
    study = f"optuna.load_study(study_name='slow', storage='sqlite:///{run_dir}/study.db')"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(list(marks.iterdir())) < 2:  # both slots busy
        time.sleep(0.2)
    kernel.manager.interrupt_kernel()
    while True:
        reply = kernel.client.get_shell_msg(timeout=60)
        if reply["msg_type"] == "execute_reply":
            break
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert "nbtrain stopped every running trial" in reply["content"]["traceback"][0]
    assert kernel.value("children()") == []
    assert kernel.value(f"sorted((t.state.name, t.user_attrs.get('{INTERRUPTED}')) for t in {study}.get_trials())") == [
        ("FAIL", True), ("FAIL", True)]
    # Again, with quick trials: the interrupted ones run first, then the rest.
    _, _, error, _ = kernel.run(f"""
def slow(x):
    nbtrain.context().log("loss", x)
    return x
swept = nbtrain.sweep(slow, {{'x': optuna.distributions.FloatDistribution(0, 1)}}, trials=4, metric='loss', devices=2,
                      accelerator='cpu', run_dir={str(run_dir)!r}, progress=False)
""")
    assert error is None, error
    trials = kernel.value(f"[(t.state.name, t.user_attrs.get('{RETRY_OF}')) for t in {study}.get_trials()]")
    assert sorted(t for t in trials if t[1] is not None) == [("COMPLETE", 0), ("COMPLETE", 1)]
    assert sum(1 for t in trials if t[0] == "COMPLETE") == 4
    assert kernel.value("children()") == []


@pytest.mark.slow
def test_in_jupyter_the_live_table_is_replaced_in_place_by_the_summary(kernel):
    _, _, error, _ = kernel.run(SETUP)
    assert error is None, error
    shown, updates = {}, []

    def hook(msg):
        kind, content = msg["msg_type"], msg["content"]
        if kind == "display_data" and "display_id" in content.get("transient", {}):
            shown[content["transient"]["display_id"]] = content["data"]
        elif kind == "update_display_data":
            updates.append((content["transient"]["display_id"], content["data"]))

    kernel.client.execute_interactive(
        "def quick(x):\n"
        "    ctx = nbtrain.context()\n"
        "    for step in range(5):\n"
        "        ctx.log('loss', x + 1 / (step + 1), step=step)\n"
        "        time.sleep(0.2)\n"
        "    return x\n"
        "study = optuna.create_study()\n"
        "swept = nbtrain.sweep(quick, {'x': optuna.distributions.FloatDistribution(0, 1)}, trials=3, metric='loss',\n"
        "                      devices=2, accelerator='cpu', study=study, progress=True)\n",
        timeout=300, output_hook=hook)
    table, curves = list(shown)  # two outputs, each then updated in place: no new output per redraw
    assert "(live; replaced by a summary when the sweep ends)" in shown[table]["text/plain"]
    final = [data for key, data in updates if key == table][-1]
    assert "finished in" in final["text/plain"] and "3 trials here (3 complete)" in final["text/plain"]
    assert '<div class="nbtrain-sweep">' in final["text/html"] and "(live;" not in final["text/plain"]
    assert "image/png" in [data for key, data in updates if key == curves][-1]
    assert kernel.value("children()") == []
