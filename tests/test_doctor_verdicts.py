"""The doctor's verdicts as pure functions: who waits, where, for whom; mismatches; stragglers; folded stacks."""
import pytest

from nbtrain.common.protocol import StepTimes, Whereabouts
from nbtrain.notebook.run.doctor import check_stall, mismatch, stall_after, stall_verdict, straggler
from nbtrain.notebook.run.stacks import fold_native


def where(rank, current=None, file="/home/me/train.py", line=8, code="time.sleep(30)", idle=90.0):
    return Whereabouts(rank, 2, current, file, line, code, idle)


REDUCE = (2, "all_reduce", (3,), "float32", "/home/me/train.py", 5)


def test_the_rank_outside_the_collective_is_the_one_the_others_wait_for():
    verdict = stall_verdict({0: where(0, REDUCE, line=5, code="dist.all_reduce(t)"), 1: where(1)})
    assert verdict.text == ("rank 0 waits in all_reduce #2 (float32[3]) at train.py:5; rank 1 is not in a collective: "
                            "at train.py:8 (time.sleep(30)). The others wait for rank 1.")
    assert verdict.culprits == [1] and verdict.waiting == [0]


def test_a_rank_that_did_not_answer_is_named_and_waited_for():
    verdict = stall_verdict({0: where(0, REDUCE, line=5, code="")}, silent=[1])
    assert "rank 1 did not say where it is (busy in C code that holds the GIL)" in verdict.text
    assert verdict.culprits == [1]


def test_ranks_at_different_collectives_have_skipped_one():
    barrier = (3, "barrier", None, None, "/home/me/train.py", 9)
    verdict = stall_verdict({0: where(0, REDUCE, line=5), 1: where(1, barrier, line=9)})
    assert "rank 0 waits in all_reduce #2" in verdict.text and "rank 1 waits in barrier #3" in verdict.text
    assert "a rank skipped one, or called one more" in verdict.text and verdict.culprits == []


def test_every_rank_in_the_same_collective_blames_the_backend():
    verdict = stall_verdict({0: where(0, REDUCE, line=5), 1: where(1, REDUCE, line=5)})
    assert "the backend is stuck" in verdict.text


def test_a_collective_called_from_a_library_names_the_users_line_too():
    verdict = stall_verdict({0: where(0, REDUCE, line=40, code="ctx.barrier()"), 1: where(1)})
    assert "all_reduce #2 (float32[3]) at train.py:5 (from train.py:40 (ctx.barrier()))" in verdict.text


@pytest.mark.parametrize("other, words", [
    ((2, "all_reduce", (4,), "float32", "/x/train.py", 5),
     "(different shapes): rank 0: all_reduce #2 (float32[3]) at train.py:5; rank 1: all_reduce #2 (float32[4]) "
     "at train.py:5."),
    ((2, "all_reduce", (3,), "float64", "/x/train.py", 5), "(different dtypes)"),
    ((2, "broadcast", (3,), "float32", "/x/train.py", 6), "(different ops)"),
])
def test_mismatches_name_each_ranks_call(other, words):
    barrier = (1, "barrier", None, None, "t.py", 1)
    said = mismatch({0: [barrier, REDUCE], 1: [barrier, other]})
    assert said.startswith("Collective #2 does not match across ranks") and words in said


def test_a_mismatch_among_eight_ranks_says_each_call_once():
    other = (2, "all_reduce", (4,), "float32", "/x/train.py", 5)
    said = mismatch({r: [other if r == 5 else REDUCE] for r in range(8)})
    assert said == ("Collective #2 does not match across ranks (different shapes): ranks 0-4, 6, 7: all_reduce #2 "
                    "(float32[3]) at train.py:5; rank 5: all_reduce #2 (float32[4]) at train.py:5.")


def test_matching_collectives_are_no_mismatch():
    assert mismatch({0: [REDUCE], 1: [REDUCE], 2: []}) is None


def times(rank, total, data, collective):
    return StepTimes(rank, 10, total, data, collective, [])


def test_a_rank_waiting_for_data_is_the_straggler():
    said = straggler({0: times(0, 10, 0.1, 6.5), 1: times(1, 10, 7.0, 0.1)})
    assert said == ("rank 1 is 2.8x slower than the others: 70 % of its step waiting for data (more DataLoader "
                    "workers, num_workers=, or a faster source)")


def test_a_rank_computing_longer_is_the_straggler():
    said = straggler({0: times(0, 10, 0.1, 5.0), 1: times(1, 10, 0.1, 0.1), 2: times(2, 10, 0.1, 5.0)})
    assert said == ("rank 1 is 2.0x slower than the others: 98 % of its step computing (a slower or busier device, "
                    "or more work in its batches: compare their sizes)")


def test_balanced_ranks_have_no_straggler():
    assert straggler({0: times(0, 10, 1, 1), 1: times(1, 10, 1.1, 0.9)}) is None
    assert straggler({0: times(0, 10, 1, 1)}) is None


def test_a_short_balanced_run_has_no_straggler():
    # The demo and the README's example: 16 batches in 0.3 s; one rank 1.3x busier by chance.
    demo = {0: StepTimes(0, 16, 0.30, 0.01, 0.07, []), 1: StepTimes(1, 16, 0.30, 0.01, 0.12, [])}
    assert straggler(demo) is None
    few = {0: StepTimes(0, 5, 20.0, 0.1, 10.0, []), 1: StepTimes(1, 5, 20.0, 0.1, 0.1, [])}
    assert straggler(few) is None  # 5 steps: too few to tell
    long = {0: StepTimes(0, 16, 30.0, 0.3, 7.0, []), 1: StepTimes(1, 16, 30.0, 0.3, 0.1, [])}
    assert straggler(long).startswith("rank 1 is 1.3x slower than the others")  # the same 1.3x, 7 s lost to it


def test_the_stall_default_and_its_checks():
    assert stall_after(None, None) == 60.0 and stall_after(None, 9.0) == 90.0
    assert stall_after(5, 9.0) == 5.0 and stall_after(False, 1.0) is None
    assert check_stall(2.5) == 2.5 and check_stall(False) is False and check_stall(None) is None
    for bad in (0, -1, True, "60"):
        with pytest.raises(ValueError, match=r"stall=.*give a positive number of seconds"):
            check_stall(bad)


def test_native_frames_fold_to_those_that_say_something():
    stack = "\n".join(["__GI___clock_nanosleep (libc.so.6)", "0x7f12 (libc.so.6)", "0x7f13 (libc.so.6)",
                       "pthread_cond_wait (libc.so.6)", "c10d::Work::wait (libtorch_cpu.so)", "_PyEval_EvalFrame",
                       "all_reduce (torch/distributed/distributed_c10d.py:3252)"])
    assert fold_native(stack).splitlines() == [
        "__GI___clock_nanosleep (libc.so.6)", "    (2 frames folded)", "pthread_cond_wait (libc.so.6)",
        "c10d::Work::wait (libtorch_cpu.so)", "    (1 frame folded)",
        "all_reduce (torch/distributed/distributed_c10d.py:3252)"]


def profiled(step, comm, idle):
    return {"steps": 2, "step_time": step, "split": {"communication": comm, "data": 0.0, "compute": step - comm - idle,
                                                     "idle": idle}, "top": [], "collective": "gloo:all_reduce"}


def test_the_profile_headline_names_the_rank_the_others_wait_for_not_the_longer_step():
    from nbtrain.display.profile import ProfileTable

    # Rank 0 waits for rank 1 and so has the longer step; rank 1 is the one to blame.
    table = ProfileTable({0: profiled(0.030, 0.020, 0.0), 1: profiled(0.025, 0.001, 0.020)})
    assert table.slowest() == 1
    assert table.verdict().startswith("slowest: rank 1, 25 ms per step, 80 % idle")
    assert "rank 0 waits for it: 67 % waiting in gloo:all_reduce" in table.verdict()
    even = ProfileTable({0: profiled(0.030, 0.001, 0.0), 1: profiled(0.031, 0.001, 0.0)})
    assert even.verdict().startswith("no rank stands out")


def test_ranks_waiting_at_different_rendezvous_addresses_are_named():
    verdict = stall_verdict({0: where(0, code="dist.init_process_group(...)")._replace(rendezvous="tcp://127.0.0.1:29411"),
                             1: where(1, code="dist.init_process_group(...)")._replace(rendezvous="tcp://127.0.0.1:29412")})
    assert verdict.text.startswith("rank 0 waits to join the process group at tcp://127.0.0.1:29411 (hosting it), at "
                                   "train.py:8 (dist.init_process_group(...)); rank 1 waits to join the process group "
                                   "at tcp://127.0.0.1:29412 (rank 0 should host it)")
    assert "The ranks wait at different addresses: give every rank the same init_method" in verdict.text


def test_eight_ranks_at_a_rendezvous_are_said_by_place():
    waiting = {r: where(r, code="ctx.barrier()")._replace(rendezvous="tcp://10.0.0.1:29400") for r in (0, 1, 2, 4, 5, 7)}
    verdict = stall_verdict({**waiting, 3: where(3), 6: where(6)})
    assert verdict.text == ("rank 0 waits to join the process group at tcp://10.0.0.1:29400 (hosting it), at train.py:8 "
                            "(ctx.barrier()); ranks 1, 2, 4, 5, 7 wait to join the process group at tcp://10.0.0.1:29400 "
                            "(rank 0 should host it), at train.py:8 (ctx.barrier()); ranks 3, 6 are not joining: at "
                            "train.py:8 (time.sleep(30)). The others wait for ranks 3, 6 to join.")


def test_a_rendezvous_waits_for_the_rank_that_never_joins():
    verdict = stall_verdict({0: where(0, code="ctx.barrier()")._replace(rendezvous="env://"), 1: where(1)})
    assert verdict.text == ("rank 0 waits to join the process group at env:// (the launch's private store), at "
                            "train.py:8 (ctx.barrier()); rank 1 is not joining: at train.py:8 (time.sleep(30)). "
                            "The others wait for rank 1 to join.")
    assert verdict.culprits == [1] and verdict.waiting == [0]


def test_the_live_view_says_a_stall_until_a_rank_progresses():
    from nbtrain.common.protocol import Hello, Progress
    from nbtrain.display import widgets
    from nbtrain.notebook.run.runmodel import RunState

    state, display = RunState("ddp on 2 CPU ranks", [0, 1]), widgets.WidgetDisplay()
    display.start(state)
    state.handle(Hello(0, 1))
    state.set_stall("rank 0 waits in all_reduce #2 at train.py:5; rank 1 is not in a collective: at train.py:8")
    display._draw_header(state)
    assert "stalled: rank 0 waits in all_reduce #2 at train.py:5; rank 1 is not" in display.snapshot()["header"]
    state.handle(Progress(0, 0, "epoch", 1, 3, False, 1.0))
    display._draw_header(state)
    assert "stalled" not in display.snapshot()["header"] and state.stall is None
    display.finish(state, True)


def test_a_worker_errors_stacks_survive_pickling():
    import pickle

    from nbtrain.common.errors import WorkerError

    error = WorkerError.from_failure(1, "timed out after 5 s", "--- rank 1 stack ---", stacks={0: "a", 1: "b"},
                                     original=ValueError("x"))
    again = pickle.loads(pickle.dumps(error))
    assert again.stacks == {0: "a", 1: "b"} and again.rank == 1 and isinstance(again, ValueError)
    assert WorkerError(0, "x").stacks == {}


def ddp_call(seq, backward, line=19, bucket=0, names="fc.weight, fc.bias"):
    return (seq, "DDP's gradient all-reduce", (5,), "float32", "/home/me/train.py", line, (backward, bucket, names))


def test_a_rank_that_ran_out_of_batches_is_named_with_the_fix():
    verdict = stall_verdict({
        0: where(0, line=22, code="time.sleep(30)")._replace(backwards=10, doing="left the loop"),
        1: where(1, ddp_call(12, 11), line=19, code="loss.backward()")._replace(backwards=11, doing="in the loop")})
    assert verdict.text == (
        "rank 1 waits in DDP's gradient all-reduce of its backward() #11 at train.py:19 (bucket 0: fc.weight, "
        "fc.bias); rank 0 ran 10 backward() calls and left the loop at train.py:22 (time.sleep(30)): the ranks had "
        "different numbers of batches — use DistributedSampler(drop_last=True) or torch.distributed.algorithms.Join.")
    assert verdict.culprits == [0] and verdict.waiting == [1]


def test_a_rank_still_in_its_loop_is_waited_for_without_blaming_the_batches():
    verdict = stall_verdict({
        0: where(0, line=17, code="time.sleep(30)")._replace(backwards=10, doing="in the loop"),
        1: where(1, ddp_call(12, 11), code="loss.backward()")._replace(backwards=11)})
    assert "different numbers of batches" not in verdict.text
    assert verdict.text.endswith("rank 0 is not in a collective: at train.py:17 (time.sleep(30)). The others wait "
                                 "for rank 0.")


def test_a_rank_stuck_loading_its_batch_is_blamed():
    verdict = stall_verdict({
        0: where(0, ddp_call(6, 5), line=19, code="loss.backward()")._replace(backwards=5),
        1: where(1, line=16, code="for x in loader:")._replace(backwards=4, doing="loading data")})
    assert verdict.text == (
        "rank 0 waits in DDP's gradient all-reduce of its backward() #5 at train.py:19 (bucket 0: fc.weight, "
        "fc.bias); rank 1 is loading its next batch at train.py:16 (for x in "
        "loader:). The others wait for rank 1: its data loading is stuck (a DataLoader worker that blocks or died, "
        "a source that does not answer): its stack shows where.")
    assert verdict.culprits == [1]


def test_many_ranks_are_grouped_by_where_they_are():
    reduce12 = (12, "all_reduce", (3,), "float32", "/home/me/train.py", 30)
    ranks = {r: where(r, reduce12, line=30, code="dist.all_reduce(t)") for r in (0, 1, 2, 3, 4, 6, 7)}
    ranks[5] = where(5, line=22, code="time.sleep(30)")
    verdict = stall_verdict(ranks)
    assert verdict.text == ("ranks 0-4, 6, 7 wait in all_reduce #12 (float32[3]) at train.py:30; rank 5 is not in a "
                            "collective: at train.py:22 (time.sleep(30)). The others wait for rank 5.")
    assert verdict.culprits == [5] and verdict.waiting == [0, 1, 2, 3, 4, 6, 7]


def test_a_rank_that_ended_is_named_with_where_the_others_wait_not_the_socket_error():
    from nbtrain.notebook.run.doctor import ended_verdict

    said = ended_verdict(0, "returned from train()", {1: ddp_call(12, 11)}, ran=10)
    assert said == ("rank 0 ended (returned from train()) while the others still needed it: rank 1 waits for it in "
                    "DDP's gradient all-reduce of its backward() #11 at train.py:19 (bucket 0: fc.weight, fc.bias); "
                    "rank 0 ran 10 backward() calls: the ranks had different numbers of batches — use "
                    "DistributedSampler(drop_last=True) or torch.distributed.algorithms.Join.")
    barrier = (3, "barrier", None, None, "/home/me/train.py", 9)
    said = ended_verdict(1, "returned from train()", {0: barrier, 2: barrier, 3: None}, ran=None)
    assert said == ("rank 1 ended (returned from train()) while the others still needed it: ranks 0, 2 wait for it "
                    "in barrier #3 at train.py:9; rank 3 waits for it (in a collective it did not report). That wait "
                    "can never complete.")


BUCKET = (9, "DDP's gradient all-reduce", (5,), "float32", "/home/me/train.py", 19, (11, 0, "fc.weight, fc.bias"))


@pytest.mark.parametrize("waiter, behind, words", [
    # Both ranks accumulate under no_sync() on the same steps: rank 1 had fewer batches, not another no_sync().
    ((11, 10, 0, ""), (10, 10, 0, ""), "rank 1 ran 10 backward() calls and left the loop at train.py:8"),
    ((11, 0, 0, ""), (10, 1, 0, ""), "rank 1 ran 1 of its 11 forwards under no_sync() (the ranks waiting: 0), now at"),
    ((11, 0, 1, ""), (11, 0, 2, ""), "rank 1 skipped backward() after 2 of its 11 forwards (10 all-reduced), now at"),
    ((11, 0, 0, ""), (11, 0, 0, "fc.bias"), "rank 1 ran backward() #11 but never all-reduced its gradients (fc.bias "
                                            "got none), now at"),
])
def test_a_backward_one_rank_never_all_reduced_is_told_by_its_ddp_forwards(waiter, behind, words):
    waits = Whereabouts(0, 9, BUCKET, "/home/me/train.py", 19, "loss.backward()", 9.0, "", 11, "in the loop", waiter)
    left = Whereabouts(1, 8, None, "/home/me/train.py", 8, "time.sleep(30)", 9.0, "", 10, "left the loop", behind)
    verdict = stall_verdict({0: waits, 1: left})
    assert words in verdict.text and verdict.culprits == [1], verdict.text


def test_ranks_that_made_the_same_mistake_are_said_together():
    waits = Whereabouts(0, 9, BUCKET, "/home/me/train.py", 19, "loss.backward()", 9.0, "", 11, "in the loop",
                        (11, 0, 0, ""))
    skipped = {r: Whereabouts(r, 8, None, "/home/me/train.py", 8, "time.sleep(30)", 9.0, "", 10, "left the loop",
                              (11, 0, 1, "")) for r in (1, 2)}
    verdict = stall_verdict({0: waits, **skipped})
    assert "; ranks 1, 2 skipped backward() after 1 of their 11 forwards (10 all-reduced), now at train.py:8" \
        in verdict.text and verdict.text.count("run backward() after every training forward") == 1, verdict.text


def test_a_collective_a_line_does_not_name_is_said_with_the_line():
    # A DTensor's redistribution (funcol's all_gather_single) or an FSDP model's forward: the line
    # says what the user wrote, the call what waits.
    gather = (4, "all_gather_single", (4, 3), "float32", "/home/me/train.py", 29)
    verdict = stall_verdict({0: where(0, gather, line=29, code="d.full_tensor().sum()"), 1: where(1)})
    assert verdict.text.startswith("rank 0 waits in all_gather_single #4 (float32[4, 3]) at train.py:29 "
                                   "(d.full_tensor().sum()); rank 1 is not in a collective"), verdict.text
