"""Ranks as the tasks of a SLURM job (submitit), against a real one-node cluster on this machine
(the session's `local_slurm`, see conftest.py): values, metrics, errors, interrupts, cells."""
import os
import re
import socket
import subprocess
import threading
import time

import psutil
import pytest

import nbtrain
from cluster_helpers import Recorder, one_rank_stalls, stack_report_problems, wait_for_the_notebook
from conftest import timed_out_in_place

pytestmark = pytest.mark.slow

SETTLE = 30.0  # generous bound for "the job has left the queue": the machine is shared and loaded


def train(steps):
    import torch
    import torch.nn.functional as F

    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randn(32, 2))
    for x, y in ctx.progress(ctx.loader(data, batch_size=4), desc="batch"):
        loss = F.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.log("loss", loss, sync_dist=True)
        if steps == 0:
            break
        steps -= 1
    print(f"rank {ctx.rank} of {ctx.world_size} done")
    big = torch.full((1 << 20,), float(ctx.rank))  # 4 MB: through shared memory, as on this machine
    return ctx.rank, os.environ["SLURM_JOB_ID"], float(sum(p.sum() for p in model.parameters())), big


def job_processes(job_id: str) -> list[int]:
    """This machine's processes that belong to SLURM job `job_id` (its tasks and steps) of this
    session's clusters: another session's (a second xdist worker's) numbers its jobs from 1 too."""
    found, cluster = [], f"nbtrain{os.getpid()}"  # conftest.LocalSlurm's ClusterName
    for proc in psutil.process_iter():
        try:
            env = proc.environ()
            if env.get("SLURM_JOB_ID") == job_id and env.get("SLURM_CLUSTER_NAME") == cluster:
                found.append(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return found


def wait_until(condition, timeout: float = SETTLE) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return condition()


def test_two_ranks_train_and_return_values_and_metrics(slurm, no_leftovers):
    result = nbtrain.launch(train, 3, devices=2, cluster=nbtrain.Slurm(), progress=False)
    ranks, jobs, sums, big = zip(*result.values)
    assert [float(b.sum()) for b in big] == [0.0, float(1 << 20)]
    assert ranks == (0, 1)
    assert jobs[0] == jobs[1], "one job, one task per rank"
    assert sums[0] == pytest.approx(sums[1]), "DDP keeps the ranks' models equal"
    assert len(result.metrics("loss", rank=0)) == 4 and len(result.metrics("loss", rank=1)) == 4
    assert result.devices == "2 CPU ranks, gloo, on SLURM"
    assert wait_until(lambda: jobs[0] not in slurm.jobs()), "the finished job left the queue"
    assert job_processes(jobs[0]) == []


def test_a_rank_exception_is_a_worker_error_naming_the_rank_and_its_node(slurm, no_leftovers):
    def fail_on(bad):
        ctx = nbtrain.context()
        if ctx.rank == bad:
            raise ValueError(f"rank {ctx.rank} refuses")
        time.sleep(60)

    with pytest.raises(nbtrain.WorkerError) as caught:
        nbtrain.launch(fail_on, 1, devices=2, cluster=nbtrain.Slurm(), progress=False)
    error = caught.value
    assert error.rank == 1 and error.node == socket.gethostname()
    assert str(error).startswith(f"rank 1 (on {socket.gethostname()}) failed: ValueError: rank 1 refuses")
    assert 'raise ValueError(f"rank {ctx.rank} refuses")' in error.traceback
    assert wait_until(lambda: not slurm.jobs()), f"the failed job left the queue: {slurm.jobs()}"


def test_the_live_view_sees_progress_metrics_and_output_while_the_job_runs(slurm, tmp_path):
    flag = tmp_path / "seen"
    recorder = Recorder(flag)
    result = nbtrain.launch(wait_for_the_notebook, str(flag), devices=2, cluster=nbtrain.Slurm(), progress=recorder)
    assert result.values == [0, 1] and recorder.seen_live
    assert (0, "rank 0 waits for the notebook to see it") in recorder.lines
    assert (1, "rank 1 waits for the notebook to see it") in recorder.lines
    assert any(n.startswith("SLURM job ") and " runs on " in n for n in recorder.notes), recorder.notes


def test_a_waiting_job_says_why_and_its_wait_is_not_a_stall(slurm, tmp_path):
    def held_longer_than(timeout, hold):
        """Launch a job held in the queue for `hold` s, longer than the run's `timeout`: the time in the
        queue must not count. The job's value (or error), what the live view was told, and whether
        the launch ended after the job's release."""
        held, released = [], []

        def release_when_held():
            def is_held():
                out = subprocess.run(["squeue", "--noheader", "--format", "%i %r"], capture_output=True, text=True)
                held[:] = [line.split()[0] for line in out.stdout.splitlines() if line.endswith("JobHeldUser")]
                return bool(held)

            if wait_until(is_held, 60):
                time.sleep(hold)
                subprocess.run(["scontrol", "release", held[0]], check=True)
                released.append(time.monotonic())

        releaser = threading.Thread(target=release_when_held)
        releaser.start()
        recorder = Recorder(tmp_path / "unused")
        try:
            result = nbtrain.launch(lambda: nbtrain.context().rank, devices=2, cluster=nbtrain.Slurm(hold=True),
                                    timeout=timeout, progress=recorder)
        except nbtrain.WorkerError as error:
            result = error
        ended = time.monotonic()
        releaser.join()
        return result, held, recorder.notes, bool(released) and ended > released[0]

    # The tasks' own start (each imports torch) counts: a timeout of 15 s, and of 30 only if the tasks
    # did not start within 15 s of their release (more than 10 s under load). One within the hold fails.
    for timeout, hold in ((15, 18), (30, 35)):
        result, held, notes, after_the_release = held_longer_than(timeout, hold)
        if not (isinstance(result, nbtrain.WorkerError) and "timed out" in str(result) and after_the_release):
            break
    assert not isinstance(result, Exception), f"{result} (ended after the release: {after_the_release})"
    assert result.values == [0, 1]
    assert f"SLURM job {held[0]} waits in the queue: PENDING (JobHeldUser)" in notes


def test_a_timeout_shows_every_rank_stack_and_cancels_the_job(slurm, no_leftovers):
    # The timeout counts from the job's start, and each task imports torch first (on a loaded
    # 2-core machine that took more than 8 s: no rank had reached the notebook to send a stack)
    error, timeout = timed_out_in_place(
        lambda timeout: nbtrain.launch(one_rank_stalls, devices=2, cluster=nbtrain.Slurm(), timeout=timeout,
                                       progress=False), "one_rank_stalls", timeouts=(15, 30))
    assert stack_report_problems(str(error), timeout) == [], str(error)
    assert wait_until(lambda: not slurm.jobs()), slurm.jobs()


def test_a_rank_that_cannot_reach_the_notebook_says_what_to_do(slurm):
    with pytest.raises(nbtrain.WorkerError) as caught:
        nbtrain.launch(lambda: 1, devices=2, cluster=nbtrain.Slurm(notebook_address="nbtrain-test.invalid"),
                       progress=False)
    text = str(caught.value)
    assert "cannot reach the notebook's channel at nbtrain-test.invalid:" in text
    assert "notebook_address=" in text
    assert wait_until(lambda: not slurm.jobs()), slurm.jobs()


def test_live_ranks_on_slurm_keep_state_leave_the_queue_when_closed_and_dial_the_address_given(slurm):
    address = next((a.address for addrs in psutil.net_if_addrs().values() for a in addrs
                    if a.family == socket.AF_INET and not a.address.startswith("127.")), None)
    given = {"notebook_address": address} if address else {}  # without one, the rest is still checked
    with nbtrain.Ranks(devices=2, cluster=nbtrain.Slurm(**given), progress=False) as ranks:
        ranks.exec("import os\nweight = 10 * (ctx.rank + 1)")
        assert ranks.eval("weight + ctx.world_size") == [12, 22]
        job = ranks.eval("os.environ['SLURM_JOB_ID']")[0]
        assert job in slurm.jobs()
        dialled = ranks.eval("os.environ['NBTRAIN_CHANNEL']")
    assert wait_until(lambda: job not in slurm.jobs()), slurm.jobs()
    if address is None:
        pytest.skip("this machine has no non-loopback IPv4 address to give the ranks (the rest passed)")
    assert all(v.startswith(f"{address}:") for v in dialled), dialled


@pytest.mark.parametrize("how", ["kill", "exit", "scancel"])
def test_a_live_rank_that_ends_between_calls_is_named_with_its_signal_code_or_cancellation(slurm, how):
    import re
    import signal

    from nbtrain.notebook.run.pool import PoolBroken

    with nbtrain.Ranks(devices=2, cluster=nbtrain.Slurm(), progress=False) as ranks:
        pids = ranks.eval("__import__('os').getpid()")
        job = ranks.eval("__import__('os').environ['SLURM_JOB_ID']")[0]
        if how == "kill":
            os.kill(pids[1], signal.SIGKILL)
            said = rf"rank 1 ended: SLURM job {job}, task 1 on \S+: Signal 9 \(SIGKILL\)"
        elif how == "exit":
            ranks[1].exec("import os, threading, time\n"
                          "threading.Thread(target=lambda: (time.sleep(0.5), os._exit(3))).start()")
            said = rf"rank 1 ended: SLURM job {job}, task 1 on \S+: exited with code 3"
        else:
            subprocess.run(["scancel", job], check=True)
            said = rf"rank \d ended: SLURM job {job} was cancelled at \S+ \(scancel\)"
        assert wait_until(lambda: "broken" in repr(ranks)), repr(ranks)
        assert re.search(said, repr(ranks)), repr(ranks)
        with pytest.raises(PoolBroken, match=said + r".*\.restart\(\)"):
            ranks.eval("1")
    assert wait_until(lambda: job not in slurm.jobs()), slurm.jobs()


@pytest.mark.parametrize("asks, reason, words", [
    ({"cpus_per_task": 64}, "PartitionConfig", "it asks for more than its partition is configured to give"),
    ({"nodes": 3}, "(PartitionConfig|PartitionNodeLimit)", "it asks for more"),  # SLURM says either
])
def test_a_job_that_can_never_start_fails_at_once_saying_why(slurm, asks, reason, words, no_leftovers):
    from nbtrain.placements.clusters.slurm import SlurmJobError

    started = time.monotonic()
    with pytest.raises(SlurmJobError) as caught:
        nbtrain.launch(print, devices=2, cluster=nbtrain.Slurm(**asks), progress=False)
    assert time.monotonic() - started < 60  # at once, not after waiting forever
    message = str(caught.value)
    assert re.search(rf"SLURM job \d+ can never start \(Slurm\(.*\)\): PENDING \({reason}\): {words}", message), message
    assert "partition debug has 1 node of 8 CPUs" in message and "nbtrain cancelled it" in message
    assert caught.value._render_traceback_() == [f"SlurmJobError: {message}"]  # one line in the notebook
    assert wait_until(lambda: not slurm.jobs()), slurm.jobs()


def test_nodes_that_do_not_exist_can_never_be_waited_for(slurm):
    from nbtrain.placements.clusters.slurm_words import never_runs, node_exists

    assert never_runs("ReqNodeNotAvail, UnavailableNodes:nosuch[1-2]", node_exists) == \
        "the nodes it asks for do not exist in this cluster: nosuch1, nosuch2"
    here = socket.gethostname().split(".")[0]  # the test cluster's one node: it exists, and may come back
    assert never_runs(f"ReqNodeNotAvail, UnavailableNodes:{here}", node_exists) is None


def test_live_ranks_that_can_never_start_fail_at_once(slurm):
    from nbtrain.placements.clusters.slurm import SlurmJobError

    with pytest.raises(SlurmJobError, match=r"can never start .*PENDING \(PartitionConfig\)"):
        nbtrain.Ranks(devices=2, cluster=nbtrain.Slurm(cpus_per_task=64), progress=False)
    assert wait_until(lambda: not slurm.jobs()), slurm.jobs()


def test_queue_timeout_bounds_the_wait_in_the_queue(slurm, no_leftovers):
    from nbtrain.placements.clusters.slurm import SlurmJobError

    started = time.monotonic()
    with pytest.raises(SlurmJobError) as caught:  # held: it could start once released, so it waits, but not long
        nbtrain.launch(print, devices=2, cluster=nbtrain.Slurm(hold=True, queue_timeout=3), progress=False)
    assert time.monotonic() - started < 60
    assert re.search(r"SLURM job \d+ waited \d+ s in the queue \(PENDING \(JobHeldUser\)\), longer than "
                     r"queue_timeout=3 \(Slurm\(queue_timeout=3, hold=True\)\); nbtrain cancelled it\.",
                     str(caught.value)), str(caught.value)
    assert wait_until(lambda: not slurm.jobs()), slurm.jobs()


def test_a_job_slurm_refuses_is_an_error_saying_what_slurm_said(slurm, no_leftovers):
    with pytest.raises(RuntimeError, match="SLURM refused the job .*invalid partition"):
        nbtrain.launch(print, devices=2, cluster=nbtrain.Slurm(partition="nbtrain-no-such-partition"), progress=False)


def test_job_folders_go_with_their_run_and_a_killed_kernel_s_with_the_next(slurm, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    orphan = tmp_path / f"job-{socket.gethostname()}-{dead.pid}-abcd1234"
    orphan.mkdir()
    (orphan / "1_submitted.pkl").write_bytes(b"a killed kernel's job")
    nbtrain.launch(print, devices=1, cluster=nbtrain.Slurm(folder=tmp_path), progress=False)
    assert list(tmp_path.iterdir()) == [], "the run's own folder and the orphan are gone"


# -- in a real kernel: interrupts and cells -------------------------------------------------------

@pytest.fixture(scope="module")
def slurm_kernel(local_slurm):
    if isinstance(local_slurm, str):
        pytest.skip(local_slurm)
    from conftest import Kernel

    kernel = Kernel()  # started after the cluster: it inherits SLURM_CONF
    _, _, error, _ = kernel.run("%load_ext nbtrain\nimport nbtrain, os, time")
    assert error is None, error
    yield kernel
    kernel.close()


def test_interrupting_the_kernel_cancels_the_job(slurm, slurm_kernel):
    slurm_kernel.client.execute("nbtrain.launch(lambda: time.sleep(300), devices=2, cluster=nbtrain.Slurm(), "
                                "progress=False)")
    assert wait_until(lambda: slurm.jobs() and job_processes(slurm.jobs()[0]), 60), "the job never ran"
    job = slurm.jobs()[0]
    assert wait_until(lambda: len([p for p in job_processes(job) if "submitit" in " ".join(
        psutil.Process(p).cmdline())]) >= 2, 60), "both tasks started"
    slurm_kernel.manager.interrupt_kernel()
    while True:
        reply = slurm_kernel.client.get_shell_msg(timeout=SETTLE)
        if reply["msg_type"] == "execute_reply":
            break
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    assert wait_until(lambda: job not in slurm.jobs()), f"job {job} is still in the queue"
    assert wait_until(lambda: not job_processes(job)), f"job {job} left processes: {job_processes(job)}"
    assert slurm_kernel.value("1 + 1") == 2


def test_a_cell_runs_on_slurm_with_names_from_earlier_cells(slurm, slurm_kernel):
    _, _, error, _ = slurm_kernel.run("offset = 100\ndef scaled(x):\n    return 2 * x + offset\n")
    assert error is None, error
    out, err, error, _ = slurm_kernel.run(
        "%%nbtrain --cluster slurm --devices 2 --no-progress\n"
        "import os, nbtrain\n"
        "ctx = nbtrain.context()\n"
        "print('on', os.environ['SLURM_JOB_ID'])\n"
        "scaled(ctx.rank)\n")
    assert error is None, error
    assert slurm_kernel.value("_nbtrain_result.values") == [100, 102]
    assert "[rank 1] on " in out + err


def test_live_ranks_started_by_the_magic_on_slurm_keep_state_across_cells(slurm, slurm_kernel):
    out, err, error, _ = slurm_kernel.run("%nbtrain start --cluster slurm --devices 2")
    assert error is None and not err.strip(), (error, err)
    job = slurm.jobs()[0]
    _, _, error, _ = slurm_kernel.run("%%ranks --no-progress\nstep = 10 * ctx.rank\nprint('job', os.environ['SLURM_JOB_ID'])")
    assert error is None, error
    out, err, error, _ = slurm_kernel.run("%%ranks --no-progress\nstep + 1")
    assert error is None, error
    assert "[rank 0] 1" in out and "[rank 1] 11" in out  # the last value, per rank
    assert slurm_kernel.value("ranks.pull('step')") == [0, 10]
    _, _, error, _ = slurm_kernel.run("%nbtrain stop")
    assert error is None, error
    assert wait_until(lambda: job not in slurm.jobs()), f"job {job} is still in the queue"


def test_the_clusters_notebook_slurm_cell_runs_on_the_cluster(slurm, slurm_kernel):
    import nbformat

    path = os.path.join(os.path.dirname(__file__), os.pardir, "notebooks", "08_clusters.ipynb")
    cells = [c.source for c in nbformat.read(path, as_version=4).cells
             if c.cell_type == "code" and {"setup", "slurm"} & set(c.metadata.get("tags", []))]
    assert len(cells) == 3, "the notebook's setup cells and its SLURM cell are tagged"
    for code in cells:
        _, _, error, _ = slurm_kernel.run(code, timeout=300)
        assert error is None, error
    assert slurm_kernel.value("slurm_here") is True
    assert slurm_kernel.value("on_slurm.devices, len(on_slurm.values)") == ("2 CPU ranks, gloo, on SLURM", 2)
