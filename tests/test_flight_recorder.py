"""NCCL's Flight Recorder as the doctor reads it (rank/flight_recorder.py) and says it (notebook/run/doctor.py).

On CPU: a dump in torch's documented layout summarised, a real dump of this torch read back (its generic
recorder records gloo's collectives too, never completing them), the environment left alone off nccl, and
the words of the verdict. On NCCL itself: tests/test_gpu.py."""
import os

import pytest
import torch
import torch.distributed as dist

import nbtrain
from nbtrain.common.protocol import Whereabouts
from nbtrain.notebook.run.doctor import stall_verdict
from nbtrain.rank import flight_recorder


def entry(seq, state, op="nccl:all_reduce", size=(1024,), group=("0", "default_pg")):
    """One recorder entry with the fields torch's Flight Recorder tutorial documents."""
    return {"record_id": seq - 1, "pg_id": 0, "process_group": group, "collective_seq_id": seq, "p2p_seq_id": 0,
            "op_id": seq, "profiling_name": op, "time_created_ns": 1724779239936775119 + seq,
            "input_sizes": [list(size)], "input_dtypes": ["Float"], "output_sizes": [list(size)],
            "output_dtypes": ["Float"], "state": state, "time_discovered_started_ns": None,
            "time_discovered_completed_ns": None, "retired": state == "completed", "timeout_ms": 600000,
            "is_p2p": False}


def dump(*entries):
    return {"version": "2.10", "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"}},
            "pg_status": {"0": {"last_enqueued_collective": len(entries), "last_started_collective": -1,
                                "last_completed_collective": 0}},
            "entries": list(entries)}


def test_the_last_collective_not_completed_is_the_summary():
    said = flight_recorder.summarise(dump(entry(55, "completed"), entry(56, "started"),
                                          entry(57, "scheduled", "nccl:_allgather_base", (4, 8))))
    assert said == ("_allgather_base", 57, ((4, 8),), ("Float",), "default_pg", "scheduled", 2)


def test_with_every_collective_completed_the_last_is_the_summary():
    json_layout = [entry(s, "completed", group=["1", "undefined"]) for s in (3, 4)]  # JSON holds the pair as a list
    assert flight_recorder.summarise(dump(*json_layout)) == ("all_reduce", 4, ((1024,),), ("Float",), "group 1",
                                                             "completed", 0)
    assert flight_recorder.summarise({"version": "2.10", "pg_config": {}}) == ()  # torch leaves out no entries


def test_the_recorder_is_turned_on_only_on_nccl_and_only_where_the_user_left_it():
    gloo = {"NBTRAIN_BACKEND": "gloo"}
    flight_recorder.turn_on(gloo)
    assert gloo == {"NBTRAIN_BACKEND": "gloo"}
    nccl = {"NBTRAIN_BACKEND": "nccl"}
    flight_recorder.turn_on(nccl)
    assert nccl["TORCH_NCCL_TRACE_BUFFER_SIZE"] == flight_recorder.BUFFER
    own = {"NBTRAIN_BACKEND": "nccl", "TORCH_FR_BUFFER_SIZE": "0"}  # the user's choice, even off
    flight_recorder.turn_on(own)
    assert own == {"NBTRAIN_BACKEND": "nccl", "TORCH_FR_BUFFER_SIZE": "0"}


def test_a_real_dump_of_this_torch_is_read_back():
    """torch's generic recorder (on by default) records this gloo group's all_reduce in the layout
    NCCL's uses; read as on nccl (`summary`'s whole path: the dump function, its thread, the JSON)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        for _ in range(3):
            dist.all_reduce(torch.ones(7, 3))
        op, seq, sizes, dtypes, group, state, pending = flight_recorder.summary({"NBTRAIN_BACKEND": "nccl"})
        assert (op, sizes, dtypes, group) == ("all_reduce", ((7, 3),), ("Float",), "default_pg")
        assert seq >= 3 and state == "scheduled" and pending >= 3  # gloo never marks one completed
        assert flight_recorder.summary({"NBTRAIN_BACKEND": "gloo"}) == ()  # not read off nccl
    finally:
        dist.destroy_process_group()


def where(rank, nccl, current=None):
    return Whereabouts(rank, 2, current, "/home/me/train.py", 19, "loss.backward()", 9.0, nccl=nccl)


def test_the_verdict_says_what_the_recorder_saw_each_rank_issue():
    started = ("all_reduce", 57, ((1024,),), ("Float",), "default_pg", "started", 1)
    behind = ("all_reduce", 56, ((1024,),), ("Float",), "default_pg", "completed", 0)
    verdict = stall_verdict({0: where(0, started), 1: where(1, behind), 2: where(2, behind)})
    assert verdict.text == (
        "ranks 0-2 are not in a collective: at train.py:19 (loss.backward()) (NCCL's flight recorder: rank 0 started "
        "all_reduce #57 (Float[1024], default_pg), not completed; ranks 1, 2 last completed all_reduce #56 "
        "(Float[1024], default_pg)). No rank is in a collective.")
    queued = ("all_reduce", 9, ((4096,),), ("Float",), "default_pg", "scheduled", 3)
    assert "rank 0 issued all_reduce #9 (Float[4096], default_pg), the last of 3 not completed" in stall_verdict(
        {0: where(0, queued)}).text


@pytest.mark.slow
def test_a_gloo_launch_keeps_its_environment_and_reads_no_recorder(no_leftovers):
    def rank():
        dist.all_reduce(torch.ones(2))
        return {k: os.environ.get(k) for k in flight_recorder.BUFFER_VARS}, flight_recorder.summary()

    result = nbtrain.launch(rank, devices=2, accelerator="cpu", start="fork", progress=False)
    assert result.value == ({k: os.environ.get(k) for k in flight_recorder.BUFFER_VARS}, ())
