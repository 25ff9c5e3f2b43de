"""launch(..., max_restarts=N): a failed run starts all ranks again; the code resumes from its checkpoint."""
import os
import re
import subprocess
import time

import pytest
import torch

import nbtrain


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


@pytest.mark.slow
def test_a_failure_beyond_the_restarts_raises_the_last_error(tmp_path, no_leftovers):
    def always_fails():
        if nbtrain.context().rank == 0:
            raise ValueError("again")

    with pytest.raises(nbtrain.WorkerError, match="rank 0 failed: ValueError: again"):
        nbtrain.launch(always_fails, devices=2, accelerator="cpu", progress=False, max_restarts=1)


def test_bad_max_restarts_are_refused():
    with pytest.raises(ValueError, match="max_restarts=-1: give a whole number of restarts, 0 or more."):
        nbtrain.launch(print, max_restarts=-1)
    with pytest.raises(ValueError, match="max_restarts=True: give a whole number of restarts, 0 or more."):
        nbtrain.launch(print, max_restarts=True, cluster=nbtrain.Slurm())


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
