"""launch(..., max_restarts=N): a failed run starts all ranks again; the code resumes from its checkpoint."""
import os
import re
import subprocess
import time

import pytest
import torch

import nbtrain
from conftest import CHILDREN
from nbtrain.notebook.ipython.cell import run_cell
from nbtrain.notebook.run import restarts
from nbtrain.notebook.run.restarts import back_off, restart_loop, restarting


def resumable(steps, where, die_at=None):
    """DDP on seeded batches, resuming from the checkpoint in `where`; rank 1 exits once at `die_at`."""
    ctx = nbtrain.context()
    torch.manual_seed(0)
    model = ctx.setup(torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpoint, start = os.path.join(where, "checkpoint"), 0
    if os.path.exists(checkpoint):
        start = ctx.load_checkpoint(checkpoint, model=model, optimizer=opt, step=0)["step"]
    for step in range(start, steps):
        if step == die_at and ctx.rank == 1 and not os.path.exists(os.path.join(where, "died")):
            open(os.path.join(where, "died"), "w").close()
            os._exit(1)
        g = torch.Generator().manual_seed(100 * step + ctx.rank)
        loss = torch.nn.functional.mse_loss(model(torch.randn(8, 4, generator=g)), torch.randn(8, 2, generator=g))
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.save_checkpoint(checkpoint, model=model, optimizer=opt, step=step + 1)
    return model.module.weight.detach().clone()


@pytest.mark.slow
def test_a_rank_that_dies_once_is_restarted_and_ends_with_the_uninterrupted_weights(tmp_path, no_leftovers):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    restarted = nbtrain.launch(resumable, 5, str(tmp_path / "a"), 2, devices=2, accelerator="cpu", progress=False,
                               max_restarts=1)
    assert (tmp_path / "a" / "died").exists()
    [why] = restarted.restarts
    assert why.startswith("rank 1 failed: exited with code 1")
    plain = nbtrain.launch(resumable, 5, str(tmp_path / "b"), devices=2, accelerator="cpu", progress=False)
    assert plain.restarts == [] and torch.equal(restarted.value, plain.value)


def fails_naming_its_attempt(where):
    """Rank 0 fails every attempt, with the attempt's number (counted in files in `where`)."""
    if nbtrain.context().rank == 0:
        attempt = len(os.listdir(where))
        open(os.path.join(where, str(attempt)), "w").close()
        raise ValueError(f"attempt {attempt}")


@pytest.mark.slow
def test_a_failure_beyond_the_restarts_raises_the_last_error(tmp_path, no_leftovers):
    # Each attempt fails with words of its own: the error raised is the second attempt's, not the first's.
    with pytest.raises(nbtrain.WorkerError, match="rank 0 failed: ValueError: attempt 1") as caught:
        nbtrain.launch(fails_naming_its_attempt, str(tmp_path), devices=2, accelerator="cpu", progress=False,
                       max_restarts=1)
    assert "attempt 0" not in str(caught.value), caught.value
    assert sorted(os.listdir(tmp_path)) == ["0", "1"]  # two attempts, no third


@pytest.mark.parametrize("given, words", [
    (-1, "max_restarts=-1: give a whole number of restarts, 0 to 100."),
    (2.0, "max_restarts=2.0: give a whole number of restarts, 0 to 100."),
    ("3", "max_restarts='3': give a whole number of restarts, 0 to 100."),
    (10**12, ("max_restarts=1000000000000: at most 100. A run that fails more often than that fails for a "
              "reason of its own")),
    (101, "max_restarts=101: at most 100."),
])
def test_bad_max_restarts_are_refused_in_one_line(given, words, tmp_path):
    for call in (lambda: nbtrain.launch(print, max_restarts=given),
                 lambda: nbtrain.submit(print, max_restarts=given, run_dir=tmp_path / "run", progress=False)):
        with pytest.raises(ValueError) as caught:
            call()
        assert str(caught.value).startswith(words) and "\n" not in str(caught.value), str(caught.value)
    assert not (tmp_path / "run").exists()  # refused before anything was written
    with pytest.raises(ValueError) as caught:  # %%nbtrain's cell under torchrun: the same bound
        run_cell("x = 1", {}, max_restarts=given)
    assert str(caught.value).startswith(words)
    with pytest.raises(ValueError, match="max_restarts=True: give a whole number of restarts, 0 to 100."):
        nbtrain.launch(print, max_restarts=True, cluster=nbtrain.Slurm())


def test_restarts_back_off_from_a_second_doubling_to_a_minute():
    assert [back_off(attempt) for attempt in range(9)] == [1, 2, 4, 8, 16, 32, 60, 60, 60]
    assert back_off(99) == 60
    assert restarting(1, 5, "rank 1 failed: exited with code 1") == \
        "restarting (2 of 5) in 2 s: rank 1 failed: exited with code 1"



def test_the_one_restart_loop_tells_each_restart_between_attempts_and_raises_what_cannot_restart(monkeypatch):
    """launch's loop and a submitted run's supervisor's are this one: attempts in order, each failure
    that restarts told (note, reason) before the next attempt, the last error or a non-restartable one raised."""
    monkeypatch.setattr(restarts, "BACK_OFF_FIRST", 0.0)  # the waits' length is the test above's
    told = []

    def attempt(n):
        told.append(("attempt", n))
        if n < 2:
            raise OSError(f"disk {n}")
        return "done"

    value, reasons = restart_loop(attempt, 3, lambda note, reason: told.append((note, reason)))
    assert value == "done" and reasons == ["OSError: disk 0", "OSError: disk 1"]
    assert told == [("attempt", 0), ("restarting (1 of 3) in 0 s: OSError: disk 0", "OSError: disk 0"),
                    ("attempt", 1), ("restarting (2 of 3) in 0 s: OSError: disk 1", "OSError: disk 1"), ("attempt", 2)]
    with pytest.raises(OSError, match="disk 1"):  # the last attempt's error
        restart_loop(attempt, 1, lambda note, reason: None)
    with pytest.raises(OSError, match="disk 0"):  # not restartable: at once
        restart_loop(attempt, 3, lambda note, reason: pytest.fail("told"), lambda error: False)


FAILS = """
import nbtrain, psutil
def fails():
    if nbtrain.context().rank == 0:
        raise ValueError("again")
""" + CHILDREN


@pytest.mark.slow
def test_a_slurm_launch_restarts_as_a_new_job_and_leaves_none(slurm, tmp_path, no_leftovers):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    result = nbtrain.launch(resumable, 4, str(tmp_path / "a"), 2, devices=2, accelerator="cpu", progress=False,
                            cluster=nbtrain.Slurm(), max_restarts=1)
    assert (tmp_path / "a" / "died").exists()
    [why] = result.restarts
    failed = re.search(r"^rank 1 \D+: .*SLURM job (\d+), task 1 on \S+: exited with code 1$", why)
    assert failed and why.count("rank 1") == 1, why  # named once: "rank 1 ended without a reply: SLURM job ..."
    plain = nbtrain.launch(resumable, 4, str(tmp_path / "b"), devices=2, accelerator="cpu", progress=False)
    assert torch.equal(result.value, plain.value)
    assert slurm.jobs() == []  # run_once returns once each attempt's job left the queue
    # The retry was a job of its own, submitted after the failed one (SLURM numbers jobs in order).
    shown = subprocess.run(["scontrol", "show", "job"], env=slurm.env, capture_output=True, text=True).stdout
    later = [int(n) for n in re.findall(r"JobId=(\d+) JobName=nbtrain\b", shown) if int(n) > int(failed[1])]
    assert later, shown[-2000:]


@pytest.mark.slow
def test_a_slurm_job_that_can_never_start_is_not_restarted(slurm, tmp_path, capsys):
    from nbtrain.placements.clusters.slurm import SlurmJobError

    never = nbtrain.Slurm(cpus_per_task=64)  # more than the node has: PENDING (PartitionConfig), cancelled at once
    with pytest.raises(SlurmJobError, match=r"can never start"):
        nbtrain.launch(print, devices=2, cluster=never, max_restarts=2, progress="text")
    shown = capsys.readouterr().out
    assert shown.count("interrupted in") == 1 and "restarting" not in shown, shown  # one attempt
    run = nbtrain.submit(print, devices=2, cluster=never, max_restarts=2, run_dir=tmp_path / "run", progress=False)
    with pytest.raises(SlurmJobError, match=r"can never start"):
        run.result(timeout=120)
    assert run.status == "failed" and run.restarts == []
    assert "restarting" not in (tmp_path / "run" / "events.jsonl").read_text()
    deadline = time.monotonic() + 60
    while slurm.jobs() and time.monotonic() < deadline:
        time.sleep(0.5)
    assert slurm.jobs() == []


def fails_on_rank_0():
    if nbtrain.context().rank == 0:
        raise ValueError("again")


@pytest.mark.slow
def test_cancel_while_a_submitted_run_waits_to_restart_ends_it_at_once(tmp_path, no_leftovers):
    run = nbtrain.submit(fails_on_rank_0, devices=2, accelerator="cpu", run_dir=tmp_path / "run", max_restarts=5,
                         progress=False)
    deadline = time.monotonic() + 120
    while not run.reason.startswith("restarting (3 of 5) in 4 s: rank 0 failed: ValueError: again"):
        assert run.status not in ("finished", "failed", "cancelled") and time.monotonic() < deadline, run.reason
        time.sleep(0.1)
    time.sleep(1)  # well inside the 4 s back-off
    run.cancel()  # returns once nothing of the run is left
    assert (run.status, run.reason) == ("cancelled", "cancelled by Run.cancel() (SIGTERM)")
    assert len(run.restarts) == 3  # no fourth attempt started


# Last in the module: the shared kernel it starts would count as a leftover of the tests above.
@pytest.mark.slow
def test_ctrl_c_while_waiting_to_restart_ends_the_launch_at_once_and_leaves_nothing(kernel):
    _, _, error, _ = kernel.run(FAILS)
    assert error is None, error
    kernel.client.execute("nbtrain.launch(fails, devices=2, accelerator='cpu', start='fork', progress='text', "
                          "max_restarts=5)")
    shown, waiting = "", "restarting (3 of 5) in 4 s: rank 0 failed: ValueError: again"
    deadline = time.monotonic() + 120
    while waiting not in shown:  # the third failure's note: the launch now sleeps 4 s
        assert time.monotonic() < deadline, shown
        message = kernel.client.get_iopub_msg(timeout=120)
        if message["msg_type"] == "stream":
            shown += message["content"]["text"]
    assert "restarting (1 of 5) in 1 s: " in shown and "restarting (2 of 5) in 2 s: " in shown, shown
    time.sleep(1)  # well inside the 4 s back-off
    kernel.manager.interrupt_kernel()
    while True:
        reply = kernel.client.get_shell_msg(timeout=30)  # at once: not after the back-off and 2 more attempts
        if reply["msg_type"] == "execute_reply":
            break
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert reply["content"]["traceback"] == [
        "KeyboardInterrupt: interrupted while waiting to restart (3 of 5); no rank was running."]
    assert kernel.value("children()") == []
    assert kernel.value("1 + 1") == 2
