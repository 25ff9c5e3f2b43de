"""The doctor on real ranks (gloo on CPU, 2, 4 and 8 ranks): stalls said while they happen, timeouts
that blame the rank the others wait for, mismatched collectives named, stragglers without a profile."""
import re
import signal
import time

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, distribute_tensor

import nbtrain
from nbtrain import WorkerError
from nbtrain.display.text import QuietDisplay
from nbtrain.notebook.run import doctor

pytestmark = pytest.mark.slow
WORLDS = [2, 4]


class Notes(QuietDisplay):
    """A display that keeps what the run said (the doctor's note among it)."""

    def __init__(self):
        super().__init__()
        self.notes = []

    def note(self, text):
        self.notes.append(text)


def late_rank(nap):
    ctx = nbtrain.context()
    ctx.barrier()
    t = torch.ones(3)
    if ctx.rank == ctx.world_size - 1:
        time.sleep(nap)  # the stuck rank: not in a collective
    dist.all_reduce(t)
    return t.tolist()


@pytest.mark.parametrize("world", WORLDS)
def test_a_stall_is_said_while_it_happens_and_the_run_goes_on(world, no_leftovers):
    notes = Notes()
    result = nbtrain.launch(late_rank, 6, devices=world, accelerator="cpu", start="fork", progress=notes, stall=1.5)
    assert result.value == [float(world)] * 3  # not killed
    said = [n for n in notes.notes if n.startswith("No rank has progressed")]
    assert len(said) == 1, notes.notes  # once
    last = world - 1
    waiting = "rank 0 waits" if world == 2 else f"ranks 0-{last - 1} wait"  # ranks at one place said together
    assert f"{waiting} in all_reduce #2 (float32[3]) at test_doctor.py:" in said[0]
    assert f"rank {last} is not in a collective: at test_doctor.py:" in said[0] and "(time.sleep(nap))" in said[0]
    assert said[0].endswith(f"The others wait for rank {last}. The run goes on: interrupt it to stop it "
                            "(stall= sets when this is said; timeout= ends a run).")


@pytest.mark.parametrize("world", WORLDS)
def test_a_timeout_blames_the_rank_the_others_wait_for(world, no_leftovers):
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(late_rank, 60, devices=world, accelerator="cpu", start="fork", progress=False, timeout=4,
                       stall=False)
    error, last = info.value, world - 1
    assert error.rank == last
    assert f"The others wait for rank {last}." in error.summary
    others = "rank 0" if world == 2 else f"ranks 0-{last - 1}"  # one line for the ranks that read the same
    assert f"then: {others}: stopped after rank {last} failed (waiting for rank {last} in all_reduce #2" in str(error)
    assert error.traceback.startswith(f"--- rank {last} stack ---")
    assert "--- rank 0 stack (waiting) ---" in error.traceback
    assert sorted(error.stacks) == list(range(world)) and "late_rank" in error.stacks[last]


def skips_a_collective(how):
    ctx = nbtrain.context()
    ctx.barrier()
    if ctx.rank == 1 and how == "raises":
        raise ValueError("a bad batch")
    if ctx.rank != 1:
        dist.all_reduce(torch.ones(2))
    return ctx.rank


@pytest.mark.parametrize("world, how", [(2, "returns"), (4, "returns"), (2, "raises"), (4, "raises"), (8, "raises")])
def test_a_skipped_collective_names_the_rank_that_skipped_it(world, how, no_leftovers):
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(skips_a_collective, how, devices=world, accelerator="cpu", start="fork", progress=False,
                       timeout=60)
    said = str(info.value)
    assert info.value.rank == 1
    if how == "returns":
        assert "rank 1 ended (returned from skips_a_collective()) while the others still needed it" in said
    else:  # the others' line says where they waited, not gloo's socket error, in one line for all of them
        others = {2: "rank 0", 4: "ranks 0, 2, 3", 8: "ranks 0, 2-7"}[world]
        assert said.startswith("rank 1 failed: ValueError: a bad batch")
        assert re.search(rf"\nthen: {others}: stopped after rank 1 failed \(waiting for rank 1 in all_reduce #\d "
                         r"\(float32\[2\]\) at test_doctor.py:\d+\)\n", said) and "Connection" not in said, said


def mismatched(kind):
    ctx = nbtrain.context()
    ctx.barrier()
    if kind == "dtype, no fatal report":  # as under another library's terminate handler
        signal.signal(signal.SIGABRT, signal.SIG_DFL)
    if kind in ("shape", "all_gather shape"):
        t = torch.ones(3 + ctx.rank)
    else:
        t = torch.ones(3, dtype=torch.float64 if ctx.rank == 1 else torch.float32)
    if kind == "all_gather shape":
        dist.all_gather([torch.zeros(3) for _ in range(ctx.world_size)], t)
    else:
        dist.all_reduce(t)
    return ctx.rank


@pytest.mark.parametrize("op, world", [("all_reduce", 2), ("all_reduce", 4), ("all_gather", 2), ("all_gather", 4),
                                       ("all_gather", 8)])
def test_mismatched_shapes_are_named(op, world, no_leftovers):
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(mismatched, "shape" if op == "all_reduce" else "all_gather shape", devices=world,
                       accelerator="cpu", start="fork", progress=False, timeout=60)
    said = info.value.summary
    assert said.startswith("Collective #2 does not match across ranks (different shapes): "
                           f"rank 0: {op} #2 (float32[3]) at test_doctor.py:"), said
    assert f"rank 1: {op} #2 (float32[4])" in said
    # the others' errors (gloo's size check, its socket error) read as where they were, in one line
    others = rf"ranks? [\d, -]+: stopped after rank {info.value.rank} failed \(in {op} #2 at test_doctor.py:\d+, the " \
        r"collective that does not match\)"
    assert re.search(rf"\nthen: {others}\n", str(info.value)) and "Connection" not in str(info.value), str(info.value)


@pytest.mark.parametrize("world", WORLDS)
def test_mismatched_dtypes_are_named(world, no_leftovers):
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(mismatched, "dtype", devices=world, accelerator="cpu", start="fork", progress=False,
                       timeout=60)
    said = info.value.summary
    # gloo either names both calls (each rank reported its own) or kills a rank inside the call,
    # named with the calls that were reported (on a loaded machine, perhaps none of the others'): by
    # its stack, or by gloo's words where its stack was not written (a kernel that ran ray.init has
    # Ray's terminate handler, inherited by a fork)
    assert ("(different dtypes)" in said and "rank 1: all_reduce #2 (float64[3])" in said) or \
        ((re.search(r"rank \d died inside all_reduce \(test_doctor.py line \d+ in mismatched\)", said) or
          re.search(r'rank \d was ended by the backend inside a collective \(".*collective mismatch', said))
         and "compare their shapes and dtypes" in said), said


def test_a_rank_aborted_without_its_stack_is_named_by_the_backend_s_words(no_leftovers):
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(mismatched, "dtype, no fatal report", devices=2, accelerator="cpu", start="fork",
                       progress=False, timeout=60)
    said = info.value.summary
    assert ("(different dtypes)" in said and "rank 1: all_reduce #2 (float64[3])" in said) or \
        (re.search(r'^rank \d was ended by the backend inside a collective \("op.preamble.length <= op.nbytes. '
                   r"\d vs \d. Received data size doesn't match expected size. Is there a distributed collective "
                   r'mismatch in your code\?"\)', said) and "compare their shapes and dtypes on every rank" in said), said


BATCHES = 16  # a rank's: 1.6 s of waiting for rank 1, beyond noise (doctor.STRAGGLER_STEPS and _SECONDS)


class SlowData(torch.utils.data.Dataset):
    def __len__(self):
        return 4 * BATCHES * nbtrain.context().world_size

    def __getitem__(self, i):
        if nbtrain.context().rank == 1:
            time.sleep(0.025)  # 0.1 s a batch: clearly above what a step takes on a loaded machine
        return torch.ones(4)


def straggles(where):
    ctx = nbtrain.context()
    ctx.barrier()
    data = SlowData() if where == "data" else [torch.ones(4)] * (4 * BATCHES * ctx.world_size)
    for x in ctx.loader(data, batch_size=4):
        if where == "compute" and ctx.rank == 1:
            time.sleep(0.1)  # clearly above what the other ranks' steps take on a loaded machine
        dist.all_reduce(x)


@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("where, words", [("data", "of its step waiting for data"),
                                          ("compute", "of its step computing")])
def test_a_straggler_is_named_without_a_profile(world, where, words, no_leftovers, capsys):
    result = nbtrain.launch(straggles, where, devices=world, accelerator="cpu", start="fork", progress="text")
    assert result.straggler is not None and result.straggler.startswith("rank 1 is ") and words in result.straggler
    assert " slower than the others: " in result.straggler
    assert sorted(result.step_times) == list(range(world)) and all(t.batches > 0 for t in result.step_times.values())
    shown = capsys.readouterr().out
    assert result.straggler in shown and "rank 0: data " in shown  # the static summary says it, with each split


def own_port(base):
    import os

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{base + rank}", rank=rank, world_size=world)


@pytest.mark.parametrize("world", WORLDS)
def test_a_rendezvous_that_never_completes_names_each_ranks_address(world, no_leftovers):
    from nbtrain.placements.base import free_port

    base = free_port()  # rank 0 hosts base; the others look for base+1.. where nobody listens
    with pytest.raises(WorkerError) as info:
        # 4 s, as the timeout test above: forked ranks call init_process_group first thing
        nbtrain.launch(own_port, base, devices=world, accelerator="cpu", start="fork", progress=False, timeout=4)
    said = info.value.summary
    assert f"rank 0 waits to join the process group at tcp://127.0.0.1:{base} (hosting it)" in said
    assert f"rank 1 waits to join the process group at tcp://127.0.0.1:{base + 1} (rank 0 should host it)" in said
    assert "The ranks wait at different addresses" in said


@pytest.mark.parametrize("world", [2])
def test_live_ranks_say_a_stall_and_keep_serving(world, no_leftovers):
    notes = Notes()
    with nbtrain.Ranks(devices=world, accelerator="cpu", start="fork", progress=False, stall=1.5) as ranks:
        assert ranks.run(late_rank, 5, progress=notes).values == [[float(world)] * 3] * world
        said = [n for n in notes.notes if n.startswith("No rank has progressed")]
        assert len(said) == 1 and f"The others wait for rank {world - 1}." in said[0], notes.notes
        assert ranks.eval("ctx.rank") == list(range(world))  # still serving


def uneven_batches(after):
    """PyTorch's Join tutorial without Join: rank 1 has one more batch than rank 0."""
    ctx = nbtrain.context()
    torch.manual_seed(0)
    model = ctx.setup(torch.nn.Sequential(torch.nn.Linear(4, 1)))
    for _ in range(10 + ctx.rank):
        loss = model(torch.ones(2, 4)).sum()
        loss.backward()  # the line DDP's gradient all-reduce is issued from
    if after == "stay":
        time.sleep(8)  # rank 0 left the loop and lives on (a while: then it returns, which ends the run)
    return ctx.rank


@pytest.mark.parametrize("world, waiting", [(2, "rank 1 waits"), (4, "ranks 1-3 wait"), (8, "ranks 1-7 wait")])
def test_uneven_inputs_are_named_with_their_fix_while_the_ranks_live(world, waiting, no_leftovers):
    notes = Notes()
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(uneven_batches, "stay", devices=world, accelerator="cpu", start="fork", progress=notes,
                       stall=2, timeout=30)
    said = [n for n in notes.notes if n.startswith("No rank has progressed")]
    assert len(said) == 1, notes.notes
    assert re.search(rf"{waiting} in DDP's gradient all-reduce of its backward\(\) #11 at test_doctor.py:\d+ "
                     r"\(bucket 0: 0.weight, 0.bias\); rank 0 ran 10 backward\(\) calls and left the loop at "
                     r"test_doctor.py:\d+ \(time.sleep\(8\)\): the ranks had different numbers of batches — use "
                     r"DistributedSampler\(drop_last=True\) or torch.distributed.algorithms.Join\.", said[0]), said[0]
    assert info.value.rank == 0 and "the ranks had different numbers of batches" in info.value.summary


def test_a_rank_that_ran_out_of_batches_and_returned_is_named_not_the_socket_error(no_leftovers):
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(uneven_batches, "return", devices=2, accelerator="cpu", start="fork", progress=False,
                       timeout=60)
    said = str(info.value)
    assert info.value.rank == 0
    assert re.search(r"rank 0 ended \(returned from uneven_batches\(\)\) while the others still needed it: rank 1 "
                     r"waits for it in DDP's gradient all-reduce of its backward\(\) #11 at test_doctor.py:\d+ "
                     r"\(bucket 0: 0.weight, 0.bias\); rank 0 ran 10 backward\(\) calls: the ranks had different "
                     r"numbers of batches", said), said
    assert "Connection" not in said and "peer" not in said, said


def rank_zero_barrier():
    ctx = nbtrain.context()
    ctx.barrier()
    if ctx.rank == 0:
        dist.barrier()  # rank 1 returns instead
    return ctx.rank


def test_a_rank_that_returned_while_another_waits_says_where_it_waits(no_leftovers):
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(rank_zero_barrier, devices=2, accelerator="cpu", start="fork", progress=False, timeout=60)
    said = str(info.value)
    assert info.value.rank == 1
    assert re.search(r"rank 1 ended \(returned from rank_zero_barrier\(\)\) while the others still needed it: "
                     r"rank 0 waits for it in barrier #\d at test_doctor.py:\d+", said), said
    assert "Connection" not in said and "peer" not in said, said


class Stuck(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        if nbtrain.context().rank == 1 and i >= 8:
            time.sleep(8)  # rank 1's data loading blocks at its third batch...
            raise TimeoutError("the source did not answer")  # ...and then fails, which ends the run
        return torch.ones(4)


def starved():
    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Linear(4, 1))
    for x in torch.utils.data.DataLoader(Stuck(), batch_size=4):
        model(x).sum().backward()


@pytest.mark.parametrize("world, others", [(2, "rank 0"), (4, "ranks 0, 2, 3"), (8, "ranks 0, 2-7")])
def test_a_rank_stuck_loading_data_is_blamed(world, others, no_leftovers):
    notes = Notes()
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(starved, devices=world, accelerator="cpu", start="fork", progress=notes, stall=2, timeout=20)
    said = [n for n in notes.notes if n.startswith("No rank has progressed")]
    assert len(said) == 1, notes.notes
    wait = r"DDP's gradient all-reduce of its backward\(\) #3 at test_doctor.py:\d+ \(bucket 0: weight, bias\)"
    assert re.search(rf"{others} waits? in {wait}; rank 1 is loading its next batch at test_doctor.py:\d+ "
                     r"\(time.sleep\(8\)\)\. The others wait for rank 1: its data loading is stuck", said[0]), said[0]
    assert info.value.rank == 1 and re.search(
        rf"\nthen: {others}: stopped after rank 1 failed \(waiting for rank 1 in {wait}\)\n", str(info.value)), str(info.value)


def first_collective_bare(hook):
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

    t = torch.ones(2)
    dist.all_reduce(t)  # no group yet: made on first need
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))  # the user's own DDP
    if hook == "own":
        model.register_comm_hook(None, fp16_compress_hook)  # the user's own hook still runs
        try:
            model.register_comm_hook(None, fp16_compress_hook)
        except RuntimeError as again:
            twice = str(again)
    with torch.no_grad():
        model.module.weight.fill_(1.0)
    model(torch.full((1, 2), float(nbtrain.context().rank))).sum().backward()
    from nbtrain.rank.tally import TALLY

    return t.tolist(), model.module.weight.grad.tolist(), TALLY.backwards, TALLY.recent[-1][1], \
        twice if hook == "own" else None


@pytest.mark.parametrize("hook", ["default", "own"])
def test_a_bare_collective_makes_the_group_and_a_users_own_ddp_is_counted(hook, no_leftovers):
    result = nbtrain.launch(first_collective_bare, hook, devices=2, accelerator="cpu", start="fork", progress=False,
                            timeout=60)
    for value in result.values:
        reduced, grad, backwards, op, twice = value
        assert reduced == [2.0, 2.0] and grad == [[0.5, 0.5]]  # averaged over the ranks, as DDP does
        assert backwards == 1 and op == "DDP's gradient all-reduce"
        assert twice == ("register_comm_hook or register_builtin_comm_hook can only be called once."
                         if hook == "own" else None)


def waits_on_async_work():
    ctx = nbtrain.context()
    ctx.barrier()
    if ctx.rank == 1:
        time.sleep(6)  # rank 1 is elsewhere...
    work = dist.all_reduce(torch.ones(3), async_op=True)
    work.wait()  # ...while rank 0 waits here, for the work it started
    return ctx.rank


def test_a_wait_on_an_async_collective_is_said_as_a_wait_in_it(no_leftovers):
    notes = Notes()
    nbtrain.launch(waits_on_async_work, devices=2, accelerator="cpu", start="fork", progress=notes, stall=1.5)
    said = [n for n in notes.notes if n.startswith("No rank has progressed")]
    assert len(said) == 1, notes.notes
    assert re.search(r"rank 0 waits in all_reduce #2 \(float32\[3\]\) at test_doctor.py:\d+ \(from "
                     r"test_doctor.py:\d+ \(work.wait\(\)\)\); rank 1 is not in a collective: at test_doctor.py:\d+ "
                     r"\(time.sleep\(6\)\)\. The others wait for rank 1\.", said[0]), said[0]


def fsdp_stall():
    from nbtrain.rank.tally import TALLY

    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1)), min_params=1)
    model(torch.ones(2, 8)).sum().backward()
    ops = sorted({call[1] for call in TALLY.recent})
    if ctx.rank == 1:
        time.sleep(4)  # rank 1 is elsewhere while rank 0's forward waits in FSDP2's all-gather
    model(torch.ones(2, 8)).sum().backward()
    return ops


def test_fsdp_s_collectives_are_counted_and_a_wait_in_them_named(no_leftovers):
    notes = Notes()
    result = nbtrain.launch(fsdp_stall, devices=2, accelerator="cpu", start="fork", strategy="fsdp", progress=notes,
                            stall=1.5, timeout=120)
    for ops in result.values:
        assert "all_gather_single" in ops and "reduce_scatter_single" in ops, ops
    said = [n for n in notes.notes if n.startswith("No rank has progressed")]
    assert len(said) == 1, notes.notes
    assert re.search(r"rank 0 waits in all_gather_single #\d+ \(float32\[\d+\]\) at test_doctor.py:\d+ "
                     r"\(model\(torch.ones\(2, 8\)\).sum\(\).backward\(\)\); rank 1 is not in a collective: at "
                     r"test_doctor.py:\d+ \(time.sleep\(4\)\)\. The others wait for rank 1\.", said[0]), said[0]


def one_of_eight_stalls(nap):
    """Rank 5 naps, then returns, while the others wait in the all-gather of a DTensor's full_tensor()."""
    ctx = nbtrain.context()
    mesh = init_device_mesh("cpu", (ctx.world_size,))
    sharded = distribute_tensor(torch.ones(ctx.world_size, 2), mesh, [Shard(0)])
    if ctx.rank == 5:
        time.sleep(nap)
        return None
    return sharded.full_tensor().sum().item()


def test_one_stalled_rank_among_eight_is_said_in_one_merged_line(no_leftovers):
    # Eight ranks, one clause per place: the seven waiting said together, in the collective DTensor
    # issues from torch's C++ ops (counted as a Python one is), the one they wait for named; then it
    # returns, and the failure says the same, merged.
    import torch._dynamo  # noqa: F401  # DTensor's first call imports it: here, once, not in 8 ranks at once (a stall)

    notes, stall = Notes(), 2
    started = time.monotonic()
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(one_of_eight_stalls, 5, devices=8, accelerator="cpu", start="fork", progress=notes,
                       stall=stall, timeout=120)
    said = [n for n in notes.notes if n.startswith("No rank has progressed")]
    assert len(said) == 1, notes.notes
    quiet = int(re.match(r"No rank has progressed for (\d+) s", said[0])[1])
    print(f"8 ranks: stall={stall} said after {quiet} s quiet, the run took {time.monotonic() - started:.1f} s")
    # #2: distribute_tensor's scatter (a torch.distributed collective DTensor imported by name) was #1.
    gather = r"all_gather_single #2 \(float32\[8, 2\]\) at test_doctor.py:\d+"
    assert re.search(rf": ranks 0-4, 6, 7 wait in {gather} \(return sharded.full_tensor\(\).sum\(\).item\(\)\); "
                     r"rank 5 is not in a collective: at test_doctor.py:\d+ \(time.sleep\(nap\)\)\. The others wait "
                     r"for rank 5\. The run goes on", said[0]), said[0]
    assert info.value.rank == 5
    assert re.fullmatch(rf"rank 5 ended \(returned from one_of_eight_stalls\(\)\) while the others still needed it: "
                        rf"ranks 0-4, 6, 7 wait for it in {gather}\. That wait can never complete\.",
                        info.value.summary), info.value.summary


def test_live_ranks_name_a_rank_that_ran_out_of_batches(no_leftovers):
    # Rank 0 returns and its process lives on: nothing breaks rank 1's wait inside backward(), the
    # doctor sees it there (no Python frame of a collective shows it) and names rank 0 within seconds.
    with nbtrain.Ranks(devices=2, accelerator="cpu", start="fork", progress=False) as ranks:
        started = time.monotonic()
        with pytest.raises(WorkerError) as info:
            ranks.run(uneven_batches, "return", timeout=90)  # bounded, should the wait go unseen
        assert time.monotonic() - started < 60
        said = info.value.summary
        assert info.value.rank == 0
        assert re.search(r"rank 0 ended \(returned from uneven_batches\(\)\) while the others still needed it: rank 1 "
                         r"waits for it in DDP's gradient all-reduce of its backward\(\) #11 at test_doctor.py:\d+ "
                         r"\(bucket 0: 0.weight, 0.bias\); rank 0 ran 10 backward\(\) calls: the ranks had different "
                         r"numbers of batches", said), said


def test_a_stall_is_said_once_stall_seconds_passed_not_twice_that(no_leftovers):
    # The ranks progress at their first barrier, then rank 1 naps: the first check (at 4 s) finds
    # them quiet for a little less than 4 s; the next comes when the stall is due, not 4 s later.
    notes = Notes()
    nbtrain.launch(late_rank, 11, devices=2, accelerator="cpu", start="fork", progress=notes, stall=4)
    said = [n for n in notes.notes if n.startswith("No rank has progressed")]
    assert len(said) == 1, notes.notes
    quiet = int(re.match(r"No rank has progressed for (\d+) s", said[0])[1])
    assert 4 <= quiet <= 6, said[0]  # checks spaced a stall apart said it at about 8 s


def joined(divide_by_initial_world_size):
    from torch.distributed.algorithms import Join

    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Linear(4, 1))
    with Join([model], divide_by_initial_world_size=divide_by_initial_world_size):
        for _ in range(3 + ctx.rank):  # the fix the doctor gives for uneven inputs
            model(torch.ones(2, 4) * (ctx.rank + 1)).sum().backward()
    return model.module.weight.grad.tolist()


@pytest.mark.parametrize("initial, expected", [(True, 6.5), (False, 13.0)])
def test_join_averages_as_torch_does_with_the_counting_hook(initial, expected, no_leftovers):
    # Rank 1's last backward() is alone: torch's DDP divides its gradient by the initial world size or
    # by the ranks still in (the values are torch's own, without the hook); a Python hook always by the first.
    result = nbtrain.launch(joined, initial, devices=2, accelerator="cpu", start="fork", progress=False, timeout=60)
    assert result.values[1] == [[expected] * 4] and result.values[0] == [[9.0] * 4]


def slow_in_its_loop():
    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Linear(4, 1))

    def train_step():
        model(torch.ones(2, 4)).sum().backward()

    for i in range(20):
        train_step()  # backward() is called in a helper; the loop is here
        if ctx.rank == 0 and i == 4:
            time.sleep(8)  # rank 0 is slow inside its loop: its batches are not the cause
    return ctx.rank


def test_a_rank_slow_inside_its_loop_is_waited_for_not_blamed_on_the_batches(no_leftovers):
    notes = Notes()
    result = nbtrain.launch(slow_in_its_loop, devices=2, accelerator="cpu", start="fork", progress=notes, stall=2,
                            timeout=60)
    assert result.values == [0, 1]  # the run went on once rank 0 came back
    said = [n for n in notes.notes if n.startswith("No rank has progressed")]
    assert len(said) == 1, notes.notes
    assert re.search(r"rank 1 waits in DDP's gradient all-reduce of its backward\(\) #6 at test_doctor.py:\d+ "
                     r"\(bucket 0: weight, bias\); rank 0 is not in a collective: at test_doctor.py:\d+ "
                     r"\(time.sleep\(8\)\)\. The others wait for rank 0\.", said[0]), said[0]


class TwoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(4, 4), torch.nn.Linear(4, 1)

    def forward(self, x, use_b=True):
        h = self.a(x)
        return self.b(h).sum() if use_b else h.sum()


def ddp_mistakes(steps, nap):
    """Rank 0 trains `steps` steps as it should; each other rank makes one of DDP's classic mistakes once:
    rank 1 skips a backward(), rank 2 runs one under no_sync(), rank 3 leaves `b` unused (at `steps - 1`)."""
    ctx = nbtrain.context()
    model = ctx.setup(TwoLayers())
    for i in range(steps):
        model.zero_grad()  # gradients to None: a parameter left unused keeps none
        if ctx.rank == 2 and i == 1:
            with model.no_sync():
                model(torch.ones(2, 4)).backward()  # accumulated here, all-reduced nowhere
            continue
        loss = model(torch.ones(2, 4), use_b=not (ctx.rank == 3 and i == steps - 1))
        if ctx.rank == 1 and i == 1:
            continue  # no backward() after this forward
        loss.backward()
    time.sleep(nap)  # ranks 1-3 are here while rank 0 waits in its last backward()
    return ctx.rank


@pytest.mark.parametrize("world, waiting", [(4, "rank 0 waits"), (8, "ranks 0, 4-7 wait")])
def test_ddps_classic_mistakes_are_named_with_their_fix_at_four_and_eight_ranks(world, waiting, no_leftovers):
    notes = Notes()
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(ddp_mistakes, 4, 6, devices=world, accelerator="cpu", start="fork", progress=notes, stall=2,
                       timeout=60)
    said = [n for n in notes.notes if n.startswith("No rank has progressed")]
    assert len(said) == 1, notes.notes
    at = r"test_doctor.py:\d+ \(time.sleep\(nap\)\)"
    assert re.search(
        rf"{waiting} in DDP's gradient all-reduce of its backward\(\) #4 at test_doctor.py:\d+ \(bucket 0: a.weight, "
        rf"a.bias, b.weight, b.bias\); rank 1 skipped backward\(\) after 1 of its 4 forwards \(3 all-reduced\), now at "
        rf"{at}; rank 2 ran 1 of its 4 forwards under no_sync\(\) \(the ranks waiting: 0\), now at {at}; rank 3 ran "
        r"backward\(\) #4 but never all-reduced its gradients \(b.weight, b.bias got none\), now at "
        rf"{at}: {re.escape(doctor.SKIPPED_FIX)}; {re.escape(doctor.NO_SYNC_FIX)}; {re.escape(doctor.UNUSED_FIX)}\.",
        said[0]), said[0]
    # Then ranks 1-3 return: the first to end is named by what it did, not as different numbers of batches.
    culprit, summary = info.value.rank, info.value.summary
    assert culprit in (1, 2, 3) and f"{waiting} for it in DDP's gradient all-reduce of its backward() #4" in summary
    fix = {1: doctor.SKIPPED_FIX, 2: doctor.NO_SYNC_FIX, 3: doctor.UNUSED_FIX}[culprit]
    assert summary.endswith(f": {fix}."), summary


def unused_mid_loop():
    ctx = nbtrain.context()
    model = ctx.setup(TwoLayers())
    for i in range(4):
        model(torch.ones(2, 4), use_b=not (ctx.rank == 1 and i == 1)).backward()


def test_a_parameter_unused_on_one_rank_is_named_when_torch_raises(no_leftovers):
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(unused_mid_loop, devices=2, accelerator="cpu", start="fork", progress=False, timeout=60)
    said = str(info.value)
    assert info.value.rank == 1
    assert re.search(r"^rank 1 failed: RuntimeError: b.weight, b.bias got no gradient in the backward\(\) at "
                     r"test_doctor.py:\d+ \(its forward did not use them\): DDP never all-reduced that backward\(\)'s "
                     r"gradients, and ranks that used them wait for them in the all-reduce — pass "
                     r"find_unused_parameters=True to DistributedDataParallel", said), said
    assert "(torch: Expected to have finished reduction in the prior iteration" in said  # torch's words kept
    assert re.search(r"rank 0: stopped after rank 1 failed \(waiting for rank 1 in DDP's gradient all-reduce of its "
                     r"backward\(\) #2 at test_doctor.py:\d+ \(bucket 0: a.weight, a.bias, b.weight, b.bias\)\)", said), said
    assert "Connection" not in said, said


def compiled_all_reduce():
    import torch.distributed._functional_collectives as funcol

    from nbtrain.rank.tally import TALLY

    dist.all_reduce(torch.zeros(1))  # a bare collective makes the group
    funcol.all_reduce(torch.zeros(1), "sum", dist.group.WORLD)  # its result never read: still counted as issued
    counted = TALLY.seq

    def double_and_reduce(x):
        return funcol.all_reduce(x * 2, "sum", dist.group.WORLD) + 1

    compiled = torch.compile(double_and_reduce, backend="eager", fullgraph=True)
    return compiled(torch.ones(3)).tolist(), TALLY.seq - counted, double_and_reduce(torch.ones(3)).tolist(), \
        TALLY.seq - counted


def test_compiled_functional_collectives_pass_the_counting_untouched(no_leftovers):
    # The wrappers step aside while dynamo traces (fullgraph: no graph break); the compiled graph
    # calls torch's C++ ops, which the doctor does not see (docs/troubleshooting.md says so).
    result = nbtrain.launch(compiled_all_reduce, devices=1, accelerator="cpu", start="fork", progress=False,
                            timeout=120)
    assert result.value == ([3.0] * 3, 0, [3.0] * 3, 1)
