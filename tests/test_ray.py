"""Ranks as Ray actors, against a real local Ray started in a real kernel: values, metrics, errors,
the live view, interrupts, cells, live ranks, a sweep's trials, a world of 8. One Ray for the
module (8 logical CPUs on this 2-core machine, one per actor, as on a bigger node): a Ray start
is seconds of CPU that the other modules' tests need."""
import importlib.util
import os
import socket
import time

import psutil
import pytest

from conftest import this_workers

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="ray is not installed (pip install 'nbtrain[ray]')")]

SETTLE = 30.0  # generous bound for "nothing is left": the machine is shared and loaded

SETUP = '''
%load_ext nbtrain
import os, socket, sys, time, psutil, ray, torch
import nbtrain
sys.path.insert(0, TESTS_DIR)  # cluster_helpers: the ranks get this import path too
from cluster_helpers import Recorder, one_rank_stalls, stack_report_problems, wait_for_the_notebook

def start_ray(deadline=240.0):
    """ray.init with an explicit, longer deadline: Ray gives its raylet a fixed 30 s to register
    with the GCS ("raylet failed to startup or the GCS has become overloaded"), short on a
    loaded machine; a failed try is shut down and tried again until ours passes."""
    give_up = time.monotonic() + deadline
    while True:
        try:
            return ray.init(num_cpus=8, include_dashboard=False)
        except Exception:
            ray.shutdown()
            if time.monotonic() > give_up:
                raise

start_ray()

def train(steps):
    import torch.nn.functional as F
    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in ctx.progress(range(steps), desc="step"):
        loss = F.mse_loss(model(torch.randn(8, 4)), torch.zeros(8, 2))
        opt.zero_grad(); loss.backward(); opt.step()
        ctx.log("loss", loss, sync_dist=True)
    print(f"rank {ctx.rank} done")
    big = torch.full((1 << 20,), float(ctx.rank))  # 4 MB: through shared memory, as on this machine
    return ctx.rank, float(sum(p.sum() for p in model.parameters())), big

def ray_is_empty():
    """Every CPU free again, every placement group nbtrain made removed."""
    groups = [g for g in ray.util.placement_group_table().values() if g["name"].startswith("nbtrain-")]
    return (ray.available_resources().get("CPU") == ray.cluster_resources()["CPU"]
            and all(g["state"] == "REMOVED" for g in groups))

def settled(check, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:
        time.sleep(0.2)
    return check()
'''


@pytest.fixture(scope="module")
def rk():
    from conftest import Kernel

    kernel = Kernel()
    try:
        _, _, error, _ = kernel.run(SETUP.replace("TESTS_DIR", repr(os.path.dirname(os.path.abspath(__file__)))),
                                    timeout=600)
        assert error is None, error
        yield kernel
    finally:  # also when the set-up failed: what it started must not fail later modules' leftover checks
        _close_with_ray(kernel)


def _close_with_ray(kernel) -> None:
    """Shut Ray down in the kernel, close the kernel, and make sure Ray's processes went with it."""
    try:
        started = psutil.Process(kernel.manager.provisioner.pid).children(recursive=True)
    except (psutil.Error, AttributeError, TypeError):
        started = []
    try:
        kernel.run("import ray; ray.shutdown()", timeout=120)
    except Exception:  # a kernel that no longer answers is closed all the same
        pass
    finally:
        kernel.close()
    _, alive = psutil.wait_procs(started, timeout=SETTLE)
    for proc in alive:  # Ray's reaper missed them: they are this fixture's, end them
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(alive, timeout=SETTLE)


def rank_actors() -> list[psutil.Process]:
    """This machine's processes that are nbtrain's Ray actors (Ray names them by class), of this test run."""
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if any("RankActor" in part for part in proc.info["cmdline"] or ()) and this_workers(proc):
            found.append(proc)
    return found


def actors_gone() -> bool:
    """Whether this run's Ray actors end within SETTLE seconds (Ray reaps a killed actor a moment later)."""
    deadline = time.monotonic() + SETTLE
    while rank_actors() and time.monotonic() < deadline:
        time.sleep(0.2)
    return rank_actors() == []


def run(kernel, code, timeout=300):
    out, err, error, _ = kernel.run(code, timeout=timeout)
    assert error is None, f"{error}\n{out}\n{err}"
    return out + err


def test_two_ranks_train_return_values_metrics_trackers_and_profiles_and_dial_this_node(rk, tmp_path):
    """One launch for what every run on Ray does (each actor is seconds of CPU on this machine):
    values, metrics, the trackers and profiles the ranks write themselves, and the address they
    dial by default (Ray's address of this node)."""
    run(rk, "def train_and_dial(steps):\n    return (*train(steps), os.environ['NBTRAIN_CHANNEL'])\n"
            f"result = nbtrain.launch(train_and_dial, 8, devices=2, cluster=nbtrain.Ray(), progress=False, "
            f"trackers='tensorboard', profile=True, run_dir={str(tmp_path)!r})")
    values = rk.value("[v[:2] for v in result.values]")
    assert [v[0] for v in values] == [0, 1]
    assert values[0][1] == pytest.approx(values[1][1]), "DDP keeps the ranks' models equal"
    assert rk.value("[float(v[2].sum()) for v in result.values]") == [0.0, float(1 << 20)]
    assert rk.value("len(result.metrics('loss', rank=0)), len(result.metrics('loss', rank=1))") == (8, 8)
    assert rk.value("result.devices") == "2 CPU ranks, gloo, on Ray"
    # 8 steps, as the profile needs: with 4 its window held too few for gloo's own op to be named
    assert sorted(rk.value("result.profile.traces()")) == [0, 1]
    assert "gloo:all_reduce" in rk.value("repr(result.profile)")
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
    node = rk.value("ray.util.get_node_ip_address()")
    assert all(v.startswith(f"{node}:") for v in rk.value("[v[3] for v in result.values]"))
    assert rk.value("settled(ray_is_empty)")


def test_a_rank_exception_is_a_worker_error_naming_the_rank_and_its_node(rk):
    run(rk, '''
def fail_on(bad):
    ctx = nbtrain.context()
    if ctx.rank == bad:
        raise ValueError(f"rank {ctx.rank} refuses")
    time.sleep(60)
try:
    nbtrain.launch(fail_on, 0, cluster=nbtrain.Ray(num_workers=2), progress=False)
except nbtrain.WorkerError as e:
    error = e
''')
    assert rk.value("error.rank, error.node") == (0, socket.gethostname())
    assert rk.value("str(error)").startswith(f"rank 0 (on {socket.gethostname()}) failed: ValueError: rank 0 refuses")
    assert 'raise ValueError(f"rank {ctx.rank} refuses")' in rk.value("error.traceback")
    assert rk.value("settled(ray_is_empty)")


def test_the_live_view_sees_progress_metrics_and_output_while_the_actors_run(rk, tmp_path):
    flag = str(tmp_path / "seen")
    run(rk, f"recorder = Recorder({flag!r})\n"
            f"seen = nbtrain.launch(wait_for_the_notebook, {flag!r}, cluster=nbtrain.Ray(num_workers=2), "
            "progress=recorder)")
    assert rk.value("seen.values, recorder.seen_live") == ([0, 1], True)
    lines = rk.value("recorder.lines")
    assert (0, "rank 0 waits for the notebook to see it") in lines
    assert (1, "rank 1 waits for the notebook to see it") in lines


def test_interrupting_the_kernel_kills_the_actors_and_frees_the_cluster(rk):
    rk.client.execute("nbtrain.launch(lambda: time.sleep(300), cluster=nbtrain.Ray(num_workers=2), progress=False)")
    deadline = time.monotonic() + 120
    while len(rank_actors()) < 2 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(rank_actors()) == 2, "the actors never started"
    time.sleep(2)  # both inside the user's function
    rk.manager.interrupt_kernel()
    while True:
        reply = rk.client.get_shell_msg(timeout=SETTLE)
        if reply["msg_type"] == "execute_reply":
            break
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    assert actors_gone(), "actor processes are left"
    assert rk.value("settled(ray_is_empty)"), rk.value("ray.available_resources(), ray.util.placement_group_table()")


def test_a_cell_runs_on_ray_with_names_from_earlier_cells(rk):
    run(rk, "offset = 100\ndef scaled(x):\n    return 2 * x + offset\n")
    out = run(rk, "%%nbtrain --cluster ray --num-workers 2 --no-progress\n"
                  "import nbtrain\n"
                  "ctx = nbtrain.context()\n"
                  "print('rank', ctx.rank, 'of', ctx.world_size)\n"
                  "scaled(ctx.rank)\n")
    assert rk.value("_nbtrain_result.values") == [100, 102]
    assert "[rank 1] rank 1 of 2" in out


def test_a_timeout_shows_every_rank_stack_and_frees_the_cluster(rk):
    run(rk, """
from conftest import timed_out_in_place
error, timeout = timed_out_in_place(lambda timeout: nbtrain.launch(
    one_rank_stalls, cluster=nbtrain.Ray(num_workers=2), timeout=timeout, progress=False), "one_rank_stalls", (8, 15))
stalled = str(error)
""")
    assert rk.value("stack_report_problems(stalled, timeout)") == [], rk.value("stalled")
    assert rk.value("settled(ray_is_empty)")


def test_live_ranks_on_ray_keep_state_an_interrupt_reaches_the_user_code_and_they_dial_the_address_given(rk):
    # (Ray's address of this node, the default, is dialled in the first test's launch.)
    run(rk, '''
ranks = nbtrain.Ranks(cluster=nbtrain.Ray(num_workers=2, notebook_address="127.0.0.1"), progress=False)
dialled = ranks.eval("__import__('os').environ['NBTRAIN_CHANNEL']")
ranks.exec("weight = 10 * (ctx.rank + 1)")
try:
    ranks.exec("while True:\\n    weight += 0", timeout=3)
except nbtrain.WorkerError as e:
    spun = str(e)
after = ranks.eval("weight + ctx.world_size")
ranks.close()
''')
    assert "timed out after 3 s" in rk.value("spun")
    assert rk.value("after") == [12, 22], "the interrupted ranks kept their state"
    assert all(v.startswith("127.0.0.1:") for v in rk.value("dialled")), rk.value("dialled")
    assert rk.value("settled(ray_is_empty)")



def test_a_submitted_run_on_ray_gives_the_launch_values_and_cancel_leaves_no_actor(rk, tmp_path):
    run(rk, f'''
def seeded(steps):
    ctx = nbtrain.context()
    torch.manual_seed(0)
    model = ctx.setup(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(steps):
        g = torch.Generator().manual_seed(100 * step + ctx.rank)
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 4, generator=g)), torch.randn(8, 2, generator=g))
        opt.zero_grad(); loss.backward(); opt.step()
        ctx.log("loss", loss.item())
    return [float(p.sum()) for p in model.parameters()]

submitted = nbtrain.submit(seeded, 4, devices=2, cluster=nbtrain.Ray(), progress=False, run_dir={str(tmp_path / "a")!r})
done = submitted.result(timeout=240)
# The same run launched from this kernel (its forks: no more actors), to compare with
plain = nbtrain.launch(seeded, 4, devices=2, accelerator="cpu", start="fork", progress=False)
''', timeout=400)
    assert rk.value("done.values == plain.values and done.metrics('loss') == plain.metrics('loss')")
    assert rk.value("(submitted.status, done.devices)") == ("finished", "2 CPU ranks, gloo, on Ray")
    assert rk.value("settled(ray_is_empty)")
    run(rk, f"endless = nbtrain.submit(lambda: time.sleep(600), cluster=nbtrain.Ray(num_workers=2), progress=False, "
            f"run_dir={str(tmp_path / 'b')!r})")
    try:
        deadline = time.monotonic() + 120
        while (len(rank_actors()) < 2 or rk.value("endless.status") != "running") and time.monotonic() < deadline:
            time.sleep(0.5)
        assert len(rank_actors()) == 2 and rk.value("endless.status") == "running", rk.value("endless.reason")
        # The supervisor joined this kernel's Ray (its own ray.init would start a second one):
        # the kernel sees its actors hold two of the CPUs.
        assert rk.value("ray.cluster_resources()['CPU'] - ray.available_resources().get('CPU', 0)") == 2
        supervisor = rk.value("__import__('json').loads((endless.dir / 'supervisor.json').read_text())['pid']")
    finally:
        run(rk, "endless.cancel()")
    assert rk.value("endless.status") == "cancelled"
    assert actors_gone(), "actor processes are left"
    assert not psutil.pid_exists(supervisor) or psutil.Process(supervisor).status() == psutil.STATUS_ZOMBIE
    assert rk.value("settled(ray_is_empty)"), rk.value("ray.available_resources(), ray.util.placement_group_table()")


def test_a_launch_on_ray_restarts_with_new_actors_and_leaves_none(rk, tmp_path):
    run(rk, f'''
def fails_once(marker):
    ctx = nbtrain.context()
    if ctx.rank == 1 and not os.path.exists(marker):
        open(marker, "w").write(str(os.getpid()))
        os._exit(3)
    return ctx.rank, os.getpid()

again = nbtrain.launch(fails_once, {str(tmp_path / "failed")!r}, cluster=nbtrain.Ray(num_workers=2), max_restarts=1,
                       progress=False)
''')
    [why] = rk.value("again.restarts")
    assert why == "rank 1 failed: Ray actor of rank 1 ended before it reported: The actor died unexpectedly before " \
                  "finishing this task.", why
    (_, _), (rank, pid) = rk.value("again.values")
    assert rank == 1 and pid != int((tmp_path / "failed").read_text()), "the retry ran in a new actor"
    assert actors_gone(), "actor processes are left"
    assert rk.value("settled(ray_is_empty)")


def test_eight_actors_form_one_world_and_leave_nothing(rk):
    """Ray's world of 8 (tests/test_scale.py has the other placements' worlds): every actor meets
    the others in a barrier, at the same moment dialling the notebook's channel."""
    run(rk, """
def meet():
    ctx = nbtrain.context()
    ctx.barrier()
    return ctx.rank, ctx.world_size

world = nbtrain.launch(meet, devices=8, accelerator="cpu", cluster=nbtrain.Ray(num_workers=8), progress=False,
                       timeout=150)
""", timeout=300)
    assert sorted(rk.value("world.values")) == [(r, 8) for r in range(8)]
    assert actors_gone(), "actor processes are left"
    assert rk.value("settled(ray_is_empty)")


def test_a_sweep_runs_its_trials_as_ray_actors(rk):
    run(rk, """
import optuna

def on_ray(x):
    nbtrain.context().log("loss", x)
    return x, os.environ.get("RAY_JOB_ID") is not None or "ray" in sys.modules

study = optuna.create_study()
for x in (0.4, 0.1):
    study.enqueue_trial({"x": x})
swept = nbtrain.sweep(on_ray, {"x": optuna.distributions.FloatDistribution(0, 1)}, trials=2, metric="loss",
                      devices=2, accelerator="cpu", study=study, cluster=nbtrain.Ray(), progress=False)
""", timeout=600)
    assert rk.value("sorted(t.value for t in study.trials)") == [0.1, 0.4]
    assert rk.value("swept.best_result.value") == (0.1, True)
    assert rk.value("settled(ray_is_empty)")  # every trial's actors gone (Ray frees an ended actor's CPU a moment later)
