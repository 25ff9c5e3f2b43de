"""ctx.save_checkpoint / ctx.load_checkpoint: DCP's sharded format under every strategy,
resumed runs equal to straight ones, and checkpoints that load onto another number of ranks."""
import errno
import os
import traceback

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import nbtrain
from nbtrain.rank.checkpoint import CheckpointError
from nbtrain.rank.context import Context

slow = pytest.mark.slow
CPU = {"accelerator": "cpu", "progress": False, "timeout": 120}  # never a hang
RUNS = {  # strategy: launch settings
    "fsdp": {"strategy": "fsdp", "devices": 2},
    "ddp": {"strategy": "ddp", "devices": 2},
    "single": {"strategy": "auto", "devices": 1},  # in this process, no process group
}


class Block(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(16, 32), torch.nn.Linear(32, 16)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.inp = torch.nn.Linear(8, 16)
        self.blocks = torch.nn.Sequential(Block(), Block())
        self.out = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x)))


_seed = torch.Generator().manual_seed(0)  # the same data in ranks that import this module afresh (script)
DATA = TensorDataset(torch.randn(64, 8, generator=_seed), torch.randint(0, 4, (64,), generator=_seed))


def parts():
    ctx = nbtrain.context()
    torch.manual_seed(0)
    model = ctx.setup(Net(), shard=(Block,))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.8)
    return ctx, model, optimizer, scheduler


def one_step(model, optimizer, batch):
    x, y = batch
    loss = F.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


def train(path, steps, resume=False, save_after=None):
    ctx, model, optimizer, scheduler = parts()
    start = 0
    if resume:
        start = ctx.load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, step=0)["step"]
    batches = list(ctx.loader(DATA, batch_size=8))
    for i in range(start, steps):
        one_step(model, optimizer, batches[i])
        scheduler.step()
        if save_after == i + 1:
            ctx.save_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, step=i + 1)
    return model, scheduler.get_last_lr(), start


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], rtol=1e-5, atol=1e-6, msg=key)


@slow
@pytest.mark.parametrize("strategy", list(RUNS))
def test_a_resumed_run_ends_where_a_straight_run_does(strategy, tmp_path, no_leftovers):
    run = {**CPU, **RUNS[strategy]}
    path = tmp_path / "ckpt"
    straight, straight_lr, _ = nbtrain.launch(train, None, 4, **run).value
    nbtrain.launch(train, path, 2, save_after=2, **run)
    shards = sorted(name for name in os.listdir(path) if name.endswith(".distcp"))
    assert len(shards) == run["devices"]  # each rank wrote its own
    resumed, resumed_lr, start = nbtrain.launch(train, path, 4, resume=True, **run).value
    assert start == 2 and resumed_lr == straight_lr
    assert_same_weights(resumed, straight)
    assert sorted(os.listdir(tmp_path)) == ["ckpt"]  # no .partial or .old beside it


def save_trained(path):
    ctx, model, optimizer, scheduler = parts()
    for batch in list(ctx.loader(DATA, batch_size=8))[:3]:
        one_step(model, optimizer, batch)
    ctx.save_checkpoint(path, model=model, optimizer=optimizer, step=3)
    return model


def load_saved(path):
    ctx, model, optimizer, _ = parts()
    step = ctx.load_checkpoint(path, model=model, optimizer=optimizer, step=0)["step"]
    state = optimizer.state_dict()["state"]
    moments = sum(s["exp_avg"].numel() if not hasattr(s["exp_avg"], "to_local") else s["exp_avg"].to_local().numel()
                  for s in state.values())
    steps = {float(s["step"]) for s in state.values()}
    return model, step, moments, steps


@slow
@pytest.mark.parametrize("writer, reader", [("fsdp", "single"), ("single", "fsdp"), ("ddp", "fsdp")])
def test_a_checkpoint_loads_onto_another_number_of_ranks(writer, reader, tmp_path, no_leftovers):
    path = tmp_path / "ckpt"
    saved = nbtrain.launch(save_trained, path, **CPU, **RUNS[writer]).value
    loaded, step, moments, steps = nbtrain.launch(load_saved, path, **CPU, **RUNS[reader]).value
    assert step == 3 and steps == {3.0}
    assert_same_weights(loaded, saved)
    every = sum(p.numel() for p in Net().parameters())
    assert moments == (every if reader == "single" else pytest.approx(every / 2, rel=0.05))  # this rank's share


def flaky(path, steps):
    """Rank 1 fails once, just after the checkpoint at step 2; the restarted ranks resume from it."""
    ctx, model, optimizer, scheduler = parts()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    start = 0
    if os.path.exists(path):
        start = ctx.load_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, step=0)["step"]
    batches = list(ctx.loader(DATA, batch_size=8))
    for i in range(start, steps):
        one_step(model, optimizer, batches[i])
        scheduler.step()
        ctx.save_checkpoint(path, model=model, optimizer=optimizer, scheduler=scheduler, step=i + 1)
        if attempt == 0 and ctx.rank == 1 and i + 1 == 2:
            raise RuntimeError("transient")
    return model, attempt, start


@slow
def test_max_restarts_resumes_from_the_last_checkpoint(tmp_path, capfd, no_leftovers):
    straight = nbtrain.launch(train, None, 4, **CPU, **RUNS["fsdp"]).value[0]
    result = nbtrain.launch(flaky, str(tmp_path / "ckpt"), 4, **CPU, **RUNS["fsdp"], launcher_options={"max_restarts": 1})
    model, attempt, start = result.value
    assert (attempt, start) == (1, 2)
    assert_same_weights(model, straight)
    assert "[rank 1] RuntimeError: transient" in capfd.readouterr().err


# -- in this process: plain state, bad input, the swap ----------------------------------------

def test_plain_state_and_schedulers_come_back(tmp_path):
    ctx = Context()
    model = ctx.setup(Net())
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    scheduler.step()
    ctx.save_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, scheduler=scheduler, epoch=7,
                        note="hello", seen=torch.arange(3))
    fresh = Net()
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=1.0)
    fresh_sched = torch.optim.lr_scheduler.StepLR(fresh_opt, step_size=1, gamma=0.5)
    got = ctx.load_checkpoint(tmp_path / "c", model=fresh, optimizer=fresh_opt, scheduler=fresh_sched, epoch=0,
                              note="", seen=torch.zeros(3, dtype=torch.long))
    assert got["epoch"] == 7 and got["note"] == "hello" and got["seen"].tolist() == [0, 1, 2]
    assert got["model"] is fresh and got["scheduler"] is fresh_sched
    assert fresh_sched.get_last_lr() == [0.5] and fresh_opt.param_groups[0]["lr"] == 0.5
    assert_same_weights(fresh, model)
    assert set(ctx.load_checkpoint(tmp_path / "c", epoch=0)) == {"epoch"}  # a part of it, alone


def test_a_new_save_replaces_the_last_whole_and_leaves_nothing_beside_it(tmp_path):
    ctx, path = Context(), tmp_path / "c"
    ctx.save_checkpoint(path, step=1)
    (tmp_path / "c.partial").mkdir()  # what a run killed while saving leaves
    (tmp_path / "c.partial" / "junk").write_text("x")
    ctx.save_checkpoint(path, step=2)
    assert ctx.load_checkpoint(path, step=0) == {"step": 2}
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_bad_input_says_what_to_do(tmp_path):
    ctx, model = Context(), Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"needs what to save by name, e\.g\. ctx\.save_checkpoint\(path, model=model"):
        ctx.save_checkpoint(tmp_path / "c")
    with pytest.raises(ValueError, match="opt=: the optimizer's parameters belong to no model given to save_checkpoint"):
        ctx.save_checkpoint(tmp_path / "c", other=Net(), opt=optimizer)
    with pytest.raises(FileNotFoundError, match=r"no checkpoint at .*missing .*if os\.path\.exists\(path\)"):
        ctx.load_checkpoint(tmp_path / "missing", model=model)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="notes exists and is not a checkpoint; nbtrain replaces only checkpoints"):
        ctx.save_checkpoint(tmp_path / "notes", model=model)
    assert (tmp_path / "notes" / "keep.txt").read_text() == "mine"


@pytest.mark.parametrize("path, error, words", [
    ("", ValueError, "save_checkpoint(path=''): give the checkpoint's directory, e.g. 'checkpoints/last'"),
    (" ", ValueError, "save_checkpoint(path=' '): give the checkpoint's directory"),
    (".", ValueError, "save_checkpoint(path='.') is the working directory: a save replaces its directory whole."),
    ("here/..", ValueError, "save_checkpoint(path='here/..') is the working directory"),
    ("..", ValueError, "save_checkpoint(path='..') is a directory above the working directory ("),
    (42, TypeError, "save_checkpoint(path=42): give the checkpoint's directory as a str or pathlib.Path"),
    (None, TypeError, "save_checkpoint(path=None): give the checkpoint's directory as a str or pathlib.Path"),
    (b"c", TypeError, "save_checkpoint(path=b'c'): give the checkpoint's directory as a str or pathlib.Path"),
])
def test_a_save_never_replaces_the_working_directory_or_takes_a_non_path(path, error, words, tmp_path, monkeypatch):
    here = tmp_path / "here"  # empty: nothing else would stop a save from replacing it
    here.mkdir()
    monkeypatch.chdir(here)
    with pytest.raises(error) as caught:
        Context().save_checkpoint(path, step=1)
    assert str(caught.value).startswith(words) and "\n" not in str(caught.value), str(caught.value)
    assert os.getcwd() == str(here) and os.listdir(here) == [] and os.listdir(tmp_path) == ["here"]


def test_a_load_of_a_name_the_checkpoint_lacks_or_of_another_shape_says_so(tmp_path):
    ctx, model = Context(), torch.nn.Linear(2, 2)
    ctx.save_checkpoint(tmp_path / "c", model=model, step=3)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(CheckpointError) as caught:
        ctx.load_checkpoint(tmp_path / "c", model=model, optimizer=optimizer, epoch=0)
    assert str(caught.value) == f"load_checkpoint: {tmp_path / 'c'} has no 'optimizer', 'epoch'; it holds model, step."
    with pytest.raises(CheckpointError) as caught:
        ctx.load_checkpoint(tmp_path / "c", model=torch.nn.Linear(3, 3))
    assert str(caught.value).startswith(f"load_checkpoint: {tmp_path / 'c'} does not fit what was given (rank 0): "
                                        "ValueError: Size mismatch between saved torch.Size([2, 2])"), str(caught.value)
    one_line_and_short(caught.value)


def test_a_load_from_an_empty_path_is_refused(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"^load_checkpoint\(path=''\): give the checkpoint's directory"):
        Context().load_checkpoint("", step=0)


# -- failures: the cause in one line, nothing left behind, the last whole checkpoint kept ---------

def big_enough_to_fill(disk) -> torch.nn.Module:
    return torch.nn.Linear(400, 400)  # 640 KB of weights: more than the 256 KB disk


def one_line_and_short(error: BaseException) -> None:
    shown = "".join(traceback.format_exception(error))
    assert len(shown) < 1500, shown  # not 5-9 KB of DCP's per-rank tracebacks
    assert "CheckpointException" not in shown and "inline_container" not in shown, shown


def test_a_full_disk_is_named_the_partial_removed_and_the_last_checkpoint_kept(small_disk):
    ctx, disk = Context(), small_disk()
    path = disk / "c"
    ctx.save_checkpoint(path, step=1)  # small: fits
    with pytest.raises(CheckpointError) as info:
        ctx.save_checkpoint(path, model=big_enough_to_fill(disk), step=2)
    error = info.value
    assert str(error) == f"save_checkpoint: no space left on device writing {path} (rank 0)"
    assert isinstance(error, OSError) and error.errno == errno.ENOSPC and error.filename == str(path)
    one_line_and_short(error)
    assert sorted(os.listdir(disk)) == ["c"]  # no c.partial keeping the disk full
    assert ctx.load_checkpoint(path, step=0) == {"step": 1}  # the last whole checkpoint is still there


def test_an_unwritable_path_is_named_with_its_cause(small_disk, tmp_path):
    ctx, model = Context(), Net()
    read_only = small_disk(read_only=True) / "c"
    with pytest.raises(CheckpointError) as info:
        ctx.save_checkpoint(read_only, model=model)
    assert str(info.value) == f"save_checkpoint: read-only file system writing {read_only} (rank 0)"
    assert info.value.errno == errno.EROFS
    one_line_and_short(info.value)
    (tmp_path / "notes.txt").write_text("a file, not a directory")
    under_a_file = tmp_path / "notes.txt" / "c"
    with pytest.raises(CheckpointError) as info:
        ctx.save_checkpoint(under_a_file, model=model)
    assert str(info.value) == f"save_checkpoint: not a directory writing {under_a_file} (rank 0)"
    assert info.value.errno == errno.ENOTDIR


def test_a_damaged_checkpoint_says_so_in_one_line(tmp_path):
    ctx, model, path = Context(), Net(), tmp_path / "c"
    ctx.save_checkpoint(path, model=model)
    [shard] = [p for p in path.iterdir() if p.suffix == ".distcp"]
    shard.write_bytes(shard.read_bytes()[:100])  # truncated, as by a copy that stopped
    with pytest.raises(CheckpointError) as info:
        ctx.load_checkpoint(path, model=model)
    message = str(info.value)
    assert message.startswith(f"load_checkpoint: {path} cannot be read (rank 0): it is damaged, or was not "
                              "written by save_checkpoint — "), message
    assert "\n" not in message
    one_line_and_short(info.value)


def test_a_save_stopped_between_its_renames_loads_the_checkpoint_before_it(tmp_path, caplog):
    ctx, path = Context(), tmp_path / "c"
    ctx.save_checkpoint(path, step=1)
    # What a kill between save's two renames leaves: the last whole checkpoint as c.old, the new one as c.partial.
    os.replace(path, tmp_path / "c.old")
    (tmp_path / "c.partial").mkdir()
    with caplog.at_level("WARNING"):
        assert ctx.load_checkpoint(path, step=0) == {"step": 1}
    assert f"{path} is missing, but {path}.old holds the checkpoint saved before it" in caplog.text
    ctx.save_checkpoint(path, step=2)  # and the next save tidies up
    assert ctx.load_checkpoint(path, step=0) == {"step": 2}
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_checkpoint_errors_pickle_with_their_fields():
    import pickle

    error = CheckpointError("save_checkpoint: no space left on device writing /x (rank 1)", errno.ENOSPC, "/x",
                            {1: "RuntimeError: unexpected pos"})
    again = pickle.loads(pickle.dumps(error))
    assert (str(again), again.errno, again.filename, again.causes) == (str(error), errno.ENOSPC, "/x", error.causes)


def save_a_big_model(path):
    ctx = nbtrain.context()
    ctx.save_checkpoint(path, model=ctx.setup(torch.nn.Linear(400, 400)))


@slow
def test_a_full_disk_on_two_ranks_is_one_line_naming_the_rank(small_disk, no_leftovers):
    disk = small_disk()
    with pytest.raises(nbtrain.WorkerError) as info:
        nbtrain.launch(save_a_big_model, str(disk / "c"), start="fork", devices=2, **CPU)
    error = info.value
    assert isinstance(error, CheckpointError) and error.errno == errno.ENOSPC  # caught as what it is
    assert error.summary.startswith(f"CheckpointError: save_checkpoint: no space left on device writing {disk}/c "
                                    "(rank"), error.summary
    assert "\n" not in error.summary and "CheckpointException" not in error.traceback
    assert os.listdir(disk) == []
