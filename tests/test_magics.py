"""%load_ext nbtrain, %%nbtrain and %nbtrain in a real Jupyter kernel."""
import re
import time

import psutil
import pytest

from conftest import CHILDREN

pytestmark = pytest.mark.slow

EARLIER_CELLS = '''
import os, math as m, time
import numpy as np
import torch, psutil
import nbtrain
scale = 3

def helper(v):
    return v * scale + offset  # `offset` comes from the %%nbtrain cell itself

def check(v):
    if v == 1:
        raise KeyError("rank one is unhappy")

''' + CHILDREN


NO_HANGS = "%nbtrain config --timeout 60"  # a cell that would hang fails instead


@pytest.fixture(scope="module")
def nb(kernel):
    for code in ("%load_ext nbtrain", NO_HANGS, EARLIER_CELLS):
        _, err, error, _ = kernel.run(code)
        assert error is None and not err, (error, err)
    return kernel


def run_ok(nb, code):
    out, err, error, results = nb.run(code)
    assert error is None, "\n".join(error["traceback"]) if error else None
    return out, err


def test_loading_the_extension_does_not_import_ipython_with_nbtrain():
    import subprocess
    import sys

    probe = "import sys, nbtrain; print('IPython' in sys.modules, callable(nbtrain.load_ipython_extension))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["False", "True"]


def test_a_cell_uses_functions_variables_and_modules_from_earlier_cells(nb):
    out, _ = run_ok(nb, """%%nbtrain --devices 2 --accelerator cpu
offset = 100
ctx = nbtrain.context()
print("rank", ctx.rank, "world", ctx.world_size, flush=True)
helper(ctx.rank) + m.sqrt(16) + float(np.ones(1)[0]) + torch.zeros(1).item()
""")
    assert "[rank 0] rank 0 world 2" in out and "[rank 1] rank 1 world 2" in out
    # %%nbtrain's defaults are launch's: DDP, the ranks forks of the kernel when that is safe
    assert nb.value("_nbtrain_result.values, _nbtrain_result.strategy, _nbtrain_result.start") == (
        [105.0, 108.0], "ddp", "fork")
    assert nb.value("'offset' in globals()") is False  # the ranks ran the cell, not the kernel
    assert nb.value("children()") == []


def test_a_failing_cell_points_at_its_own_lines(nb):
    _, _, error, _ = nb.run("""%%nbtrain --devices 2 --accelerator cpu
import os
x = nbtrain.context().rank
check(x)
""")
    assert error["ename"] == "WorkerError"
    shown = "\n".join(error["traceback"])
    assert "rank 1 failed: KeyError: 'rank one is unhappy'" in shown
    assert 'File "<nbtrain cell>", line 3, in <module>\n    check(x)' in shown  # the cell's own line 3
    assert 'raise KeyError("rank one is unhappy")' in shown  # and the earlier cell's source
    assert "cell.py" not in shown and "run_rank" not in shown
    assert nb.value("children()") == []


def test_a_plain_torchrun_script_runs_unchanged(nb):
    out, _ = run_ok(nb, """%%nbtrain --start torchrun --devices 2 --accelerator cpu
import torch
import torch.distributed as dist

def main():
    dist.init_process_group("gloo")  # from torchrun's environment, as in any torchrun script
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {dist.get_rank()} of {dist.get_world_size()}: sum {t.item()}", flush=True)
    dist.destroy_process_group()
    return t.item()

if __name__ == "__main__":
    total = main()
total
""")
    assert "[rank 0] rank 0 of 2: sum 3.0" in out and "[rank 1] rank 1 of 2: sum 3.0" in out
    assert nb.value("_nbtrain_result.values, _nbtrain_result.start") == ([3.0, 3.0], "torchrun")


def test_earlier_functions_that_use_nbtrain_travel_after_a_widget_display(nb):
    # The cells before this one drew widgets; `uses_context` refers to the nbtrain module.
    run_ok(nb, "def uses_context():\n    return nbtrain.context().world_size")
    run_ok(nb, "%%nbtrain --devices 2 --accelerator cpu\nuses_context()")
    assert nb.value("_nbtrain_result.values") == [2, 2]


def test_launch_under_torchrun_ships_notebook_functions_and_classes(nb):
    run_ok(nb, """
class Doubler(torch.nn.Module):
    def forward(self, x):
        return 2 * x

def train(k):
    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Sequential(torch.nn.Linear(2, 2), Doubler()))
    model(torch.ones(1, 2)).sum().backward()
    ctx.log("k", k * scale, sync_dist=True)
    return model.module
r = nbtrain.launch(train, 2, strategy="ddp", start="torchrun", devices=2, accelerator="cpu", progress=False)
""")
    assert nb.value("isinstance(r.value[1], Doubler), r.metrics('k')") == (True, [6.0])
    assert nb.value("children()") == []


def test_other_nodes_are_told_their_own_magic_line():
    from nbtrain.notebook.ipython.magics import DEFAULTS, rerun_line

    options = {**DEFAULTS, "devices": "2", "accelerator": "cpu", "nnodes": 2, "rdzv_endpoint": "10.0.0.1:29400"}
    line = rerun_line(options).replace("{node_rank}", "1")
    assert line == ("%%nbtrain --strategy auto --start torchrun --devices 2 --accelerator cpu --nnodes 2 --node-rank 1 "
                    "--rdzv-endpoint 10.0.0.1:29400")


@pytest.mark.parametrize("options, devices, values, how", [
    ("--start template", 2, [100, 103], ("ddp", "template")), ("--start spawn", 2, [100, 103], ("ddp", "spawn")),
    ("--strategy ddp_spawn", 2, [100, 103], ("ddp", "template")),  # an earlier name: the same pair
    ("--strategy dp", 1, [100], ("dp", "kernel")), ("", 1, [100], ("single", "kernel")),
])
def test_every_start_runs_the_cell(nb, options, devices, values, how):
    run_ok(nb, f"""%%nbtrain {options} --devices {devices} --accelerator cpu
offset = 100
helper(nbtrain.context().rank)
""")
    assert nb.value("_nbtrain_result.values, (_nbtrain_result.strategy, _nbtrain_result.start)") == (values, how)
    # One device runs the cell in the kernel itself: its names stay, as a plain cell's would.
    assert nb.value("globals().pop('offset', None)") == (100 if how[1] == "kernel" else None)
    assert nb.value("children()") == []


@pytest.mark.parametrize("line, words", [
    ("--strategy horovod", "argument --strategy: invalid choice: 'horovod' (choose from 'auto', 'ddp', 'fsdp', 'dp', "
                           "'deepspeed', 'ddp_fork'"),
    ("--start forkserver", "argument --start: invalid choice: 'forkserver' (choose from 'auto', 'fork', 'template', "
                           "'spawn', 'torchrun')"),
    ("--strategy dp --start fork --accelerator cpu --devices 1", "strategy='dp' with start='fork': 'dp' runs in this "
                                                                 "kernel"),
    ("--strategy ddp_fork --start torchrun", "strategy='ddp_fork' with start='torchrun': 'ddp_fork' is the earlier "
                                             "name of strategy='ddp', start='fork'"),
    ("--devices x --accelerator cpu", "devices='x': on CPU, give a number of ranks. Accepted:"),
    ("--nnodes 0", "argument --nnodes: 0 is too small: give an integer >= 1"),
    ("--timeout -1", "argument --timeout: '-1': give a positive number of seconds"),
    ("--stall soon", "argument --stall: 'soon': give a positive number of seconds without progress before the doctor "
                     "says where each rank is, or off to never check (default: max(60 s, 10x the recent step time))"),
    ("--stall 0", "argument --stall: '0': give a positive number of seconds without progress"),
    ("--stall 5 --submit", "--stall applies to a run this kernel watches; a --submit run keeps the default"),
    ("--rdzv-endpoint nohost", "argument --rdzv-endpoint: rdzv_endpoint='nohost': give HOST:PORT"),
    ("--nnodes 2 --accelerator cpu", "num_nodes=2 needs rdzv_endpoint='HOST:PORT'"),
    ("--strategy dp --launcher accelerate --accelerator cpu", "--launcher accelerate starts a script under torchrun: it "
     "needs --start torchrun (or auto) and --strategy auto, ddp or fsdp (got --strategy dp --start auto)."),
    ("--start fork --node-rank 1 --nnodes 2", "--node-rank 1 starts a script under torchrun: it needs --start torchrun"),
    ("--bogus 1", "unrecognized arguments: --bogus 1"),
])
def test_bad_options_are_usage_errors_and_the_cell_does_not_run(nb, line, words):
    out, err, error, _ = nb.run(f"%%nbtrain {line}\nprint('the cell ran')")
    assert error is None and "the cell ran" not in out
    assert f"UsageError: {words}" in err
    assert len(err.strip().splitlines()) == 1  # one line, no traceback


def test_a_missing_launcher_package_is_a_usage_error(nb):
    # A None entry in sys.modules makes the package absent to the kernel, installed or not.
    run_ok(nb, "import sys; hidden = sys.modules.get('accelerate'); sys.modules['accelerate'] = None")
    try:
        _, err, _, _ = nb.run("%%nbtrain --launcher accelerate --accelerator cpu\nprint('the cell ran')")
    finally:
        run_ok(nb, "sys.modules.pop('accelerate'); hidden is None or sys.modules.setdefault('accelerate', hidden)")
    assert "UsageError: launcher='accelerate' needs the 'accelerate' package" in err and "pip install accelerate" in err


def test_config_sets_session_defaults(nb):
    out, _ = run_ok(nb, "%nbtrain config --devices 2 --accelerator cpu --start template")
    assert "--strategy auto --start template --devices 2 --accelerator cpu" in out and "--timeout 60.0" in out
    try:
        run_ok(nb, "%%nbtrain\nnbtrain.context().world_size")
        assert nb.value("_nbtrain_result.values, _nbtrain_result.start") == ([2, 2], "template")
        out, _ = run_ok(nb, "%nbtrain config")
        assert "(set by %nbtrain config: --start, --devices, --accelerator, --timeout)" in out
    finally:
        out, _ = run_ok(nb, "%nbtrain config reset")
        run_ok(nb, NO_HANGS)
    assert "--strategy auto --start auto --devices auto --accelerator auto" in out and "config: none" in out


def test_gpus_shows_the_gpu_table(nb):
    _, _, error, results = nb.run("%nbtrain gpus")
    assert error is None
    text = results[0]["text/plain"]
    assert text.startswith("no GPU visible") or text.startswith("GPU")
    assert "text/html" in results[0]


def test_unknown_command(nb):
    _, err, _, _ = nb.run("%nbtrain train")
    assert "UsageError: %nbtrain: unknown command 'train'. Accepted: `%nbtrain config [options]`" in err


def test_an_unpicklable_name_is_refused_before_anything_starts(nb):
    run_ok(nb, "batches = (i for i in range(3))")
    _, _, error, _ = nb.run("%%nbtrain --start template --devices 2 --accelerator cpu\nnext(batches)")
    assert error["ename"] == "UnpicklableError"
    assert "batches: generator" in "\n".join(error["traceback"])


def test_interrupting_the_cell_stops_torchrun_and_every_rank(nb):
    client = nb.client
    msg_id = client.execute("""%%nbtrain --start torchrun --devices 2 --accelerator cpu
import os, time
print("ready", os.getpid(), flush=True)
time.sleep(120)
""")
    pids, deadline = [], time.monotonic() + 60
    while len(pids) < 2 and time.monotonic() < deadline:
        msg = client.get_iopub_msg(timeout=deadline - time.monotonic())
        if msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "stream":
            pids += [int(line.split()[-1]) for line in msg["content"]["text"].splitlines() if " ready " in line]
    assert len(pids) == 2, "the ranks did not start"
    interrupted = time.monotonic()
    nb.manager.interrupt_kernel()
    reply = client.get_shell_msg(timeout=30)
    while reply["parent_header"].get("msg_id") != msg_id:
        reply = client.get_shell_msg(timeout=30)
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    assert time.monotonic() - interrupted < 10
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    assert nb.value("children()") == []


LIGHTNING_SETUP = '''
import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
    def training_step(self, batch, _):
        x, y = batch
        return torch.nn.functional.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

data = TensorDataset(torch.randn(32, 4), torch.randn(32, 1))
'''


def test_lightning_trainer_ddp_runs_unchanged(nb):
    pytest.importorskip("pytorch_lightning")
    run_ok(nb, LIGHTNING_SETUP)
    out, err = run_ok(nb, """%%nbtrain --devices 2 --accelerator cpu
trainer = pl.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=1, limit_train_batches=3,
                     enable_progress_bar=False, logger=False, enable_checkpointing=False, enable_model_summary=False)
trainer.fit(Tiny(), DataLoader(data, batch_size=4))
trainer.global_rank, trainer.world_size, trainer.global_step
""")
    assert nb.value("_nbtrain_result.values") == [(0, 2, 3), (1, 2, 3)]
    # torchrun's env: no relaunch. The banner shows once per launch, from whichever rank said it first.
    assert re.search(r"\[rank ([01])\] Initializing distributed: GLOBAL_RANK: \1, MEMBER: [12]/2", out + err), out + err
    assert nb.value("children()") == []


def test_a_cell_feeds_tensorboard_and_is_profiled(nb, tmp_path):
    run_ok(nb, f"""%%nbtrain --devices 2 --accelerator cpu --start fork --trackers tensorboard --profile --run-dir {tmp_path}
ctx = nbtrain.context()
for i in ctx.progress(range(8)):
    ctx.all_gather(torch.ones(2))
    ctx.log("loss", 1.0 / (i + 1), sync_dist=True)
""")
    assert nb.value("sorted(_nbtrain_result.profile.traces())") == [0, 1]
    assert "gather" in nb.value("repr(_nbtrain_result.profile)")  # gloo:all_gather, c10d::allgather_
    assert len(list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))) == 1
    _, err, error, _ = nb.run("%%nbtrain --trackers tensorbord\nprint('the cell ran')")
    assert "UsageError: argument --trackers: invalid choice: 'tensorbord'" in err and len(err.strip().splitlines()) == 1


def test_a_cell_with_stall_says_where_each_rank_waits(nb):
    out, err = run_ok(nb, """%%nbtrain --devices 2 --accelerator cpu --start fork --stall 3
import torch.distributed as dist
ctx = nbtrain.context()
ctx.barrier()
if ctx.rank == 1:
    time.sleep(9)
dist.all_reduce(torch.ones(2))
ctx.rank
""")
    said = out + err
    assert "No rank has progressed for " in said, said
    # Lines are the cell's own, below its magic line.
    assert "rank 0 waits in all_reduce #2 (float32[2]) at <nbtrain cell>:6;" in said
    assert "rank 1 is not in a collective: at <nbtrain cell>:5 (time.sleep(9))" in said
    assert "The others wait for rank 1." in said
    assert nb.value("_nbtrain_result.values") == [0, 1]  # the run went on
    assert nb.value("children()") == []


def test_stall_off_and_on_for_live_ranks_and_config(nb):
    out, _ = run_ok(nb, "%nbtrain config --stall off")
    try:
        assert "--timeout 60.0 --stall off" in out and "(set by %nbtrain config: --timeout, --stall)" in out
    finally:
        run_ok(nb, "%nbtrain config reset")
        run_ok(nb, NO_HANGS)
    _, err, _, _ = nb.run("%nbtrain start --stall -2 --devices 2 --accelerator cpu")
    assert "UsageError: argument --stall: '-2': give a positive number of seconds" in err
    assert len(err.strip().splitlines()) == 1
    run_ok(nb, "%nbtrain start --devices 2 --accelerator cpu --start fork --stall 2.5")
    try:
        assert nb.value("ranks.stall") == 2.5
    finally:
        run_ok(nb, "%nbtrain stop")
    assert nb.value("children()") == []
