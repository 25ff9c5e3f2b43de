"""The records the notebook and its ranks exchange, and a run's event logs: every event written
by this version reads back as itself, a log of version 1 (no header, positional lists) reads back
as the same records, and a newer format is refused in words."""
import json

import pytest

from nbtrain.common import protocol, runlog
from nbtrain.common.protocol import (
    AttemptEnded,
    AttemptStarted,
    BatchSize,
    Failed,
    Finished,
    Hello,
    Metric,
    Note,
    Output,
    Progress,
    Stopped,
    Vital,
)

EVENTS = [AttemptStarted("ddp on 2 CPU ranks, gloo", [0, 1], 1.7e9), Note("restarting (1 of 2): rank 1 failed"),
          Hello(0, 123, "node"), Progress(0, 1, "batch", 3, 10, False, 12.5, 2), Metric(4, 1, "loss", 0.25, True),
          Metric(5, 0, ("a", 1), 2.0, False), BatchSize(1, 8, 16), Output(1, "stderr", "warning"),
          Vital(3.5, 1, 12.0, 2**20, None, None, None), Finished(0, "returned from train()"),
          Failed(1, "ValueError: no", "Traceback ...", False), Stopped(0, "stopped (rank 1 failed)", ""),
          AttemptEnded(False, 1.7e9 + 5)]

# The same events as version 1 wrote them: [attempt, kind, rank, *fields]
V1 = [[0, "start", None, "ddp on 2 CPU ranks, gloo", [0, 1], 1.7e9], [0, "note", None, "restarting (1 of 2): rank 1 failed"],
      [0, "hello", 0, 123, "node"], [0, "progress", 0, 1, "batch", 3, 10, False, 12.5, 2],
      [0, "metric", 1, 4, "loss", 0.25, True], [0, "metric", 0, 5, ["a", 1], 2.0, False], [0, "batch_size", 1, 8, 16],
      [0, "output", 1, "stderr", "warning"], [0, "vital", 1, 3.5, 12.0, 2**20, None, None, None],
      [0, "finished", 0, "returned from train()"], [0, "failed", 1, "ValueError: no", "Traceback ...", False],
      [0, "stopped", 0, "stopped (rank 1 failed)", ""], [0, "end", None, False, 1.7e9 + 5]]


def test_every_event_reads_back_as_itself(tmp_path):
    log = runlog.EventLog(tmp_path / "events.jsonl")
    for event in EVENTS:
        log.write(2, event)
    log.close()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    assert json.loads(lines[0]) == {"log": protocol.HEADER, "version": protocol.VERSION}
    assert json.loads(lines[4])["kind"] == "progress" and json.loads(lines[4])["initial"] == 2  # fields by name
    assert runlog.Tail(tmp_path / "events.jsonl").read() == [(2, event) for event in EVENTS]
    again = runlog.EventLog(tmp_path / "events.jsonl")  # a restart's attempt appends: no second header
    again.write(3, Note("again"))
    again.close()
    assert runlog.Tail(tmp_path / "events.jsonl").read()[-1] == (3, Note("again"))
    assert (tmp_path / "events.jsonl").read_text().count(protocol.HEADER) == 1


def test_a_log_of_version_1_reads_back_as_the_same_events(tmp_path):
    (tmp_path / "old.jsonl").write_text("".join(json.dumps(line) + "\n" for line in V1))
    assert runlog.Tail(tmp_path / "old.jsonl").read() == [(0, event) for event in EVENTS]


def test_events_logged_before_a_field_existed_get_its_default():
    logged = protocol.read_event([0, "progress", 0, 0, "epoch", 5, 50, False], 1)  # before `at` and `initial`
    assert logged.event == Progress(0, 0, "epoch", 5, 50, False, None, 0)
    assert protocol.read_event([0, "finished", 1], 1).event == Finished(1, "")


@pytest.mark.parametrize("line", [[0, "junk"], "odd", [0, "metric", 0], [0, "note", None, "a", "b", "c"], {"x": 1},
                                  {"attempt": 0, "kind": "metric", "rank": 0}, {"attempt": "0", "kind": "note", "text": ""},
                                  [0, "unknown", 0, 1]])
def test_a_line_that_is_no_event_of_ours_is_skipped(line):
    assert protocol.read_event(line, 1 if isinstance(line, (list, str)) else protocol.VERSION) is None


def test_a_newer_format_is_refused_in_words(tmp_path):
    (tmp_path / "new.jsonl").write_text(json.dumps({"log": protocol.HEADER, "version": protocol.VERSION + 1}) + "\n")
    with pytest.raises(ValueError, match=r"a run log of format 3: this nbtrain reads formats 1 to 2 \(a newer nbtrain "
                                         r"wrote it\)"):
        runlog.Tail(tmp_path / "new.jsonl").read()
    runlog.write_json(tmp_path / "run.json", {"function": "f", "version": protocol.VERSION + 1})
    with pytest.raises(ValueError, match=r"run.json' is of format 3: this nbtrain reads formats 1 to 2"):
        runlog.read_spec(tmp_path / "run.json")


def test_run_json_carries_the_version_and_an_older_one_reads_as_version_1(tmp_path):
    runlog.write_spec(tmp_path / "run.json", {"function": "f"})
    assert json.loads((tmp_path / "run.json").read_text()) == {"function": "f", "version": protocol.VERSION}
    runlog.write_json(tmp_path / "old.json", {"function": "f"})
    assert runlog.read_spec(tmp_path / "old.json", "function") == {"function": "f", "version": 1}


def test_commands_are_named_by_kind_and_every_record_kind_is_one_of_a_kind():
    assert protocol.command("exec", 3, True, "x = 1", "<cell>", False) == \
        protocol.Exec(seq=3, everyone=True, source="x = 1", filename="<cell>", want_repr=False)
    assert protocol.command("debug", 4, False) == protocol.Debug(4, False, ())
    records = [v for v in vars(protocol).values() if isinstance(v, type) and issubclass(v, tuple) and
               hasattr(v, "_fields") and v is not protocol.Logged]
    commands = {*protocol.COMMANDS.values(), protocol.Names, protocol.Interrupt, protocol.Stacks, protocol.Stdin,
                protocol.Stop}
    for family in (commands, set(records) - commands):  # a rank dispatches the one, the notebook and its logs the other
        kinds = [r.kind for r in family]
        assert len(kinds) == len(set(kinds)), sorted(kinds)
    assert set(protocol.LOGGED.values()) <= set(records)


def test_a_pickle_naming_a_module_the_notebook_side_moved_still_reads(tmp_path):
    """A run directory written before the notebook side's wings (0.2) names its classes' modules as
    they were (a submitted sweep's result.pkl holds nbtrain.notebook.sweep's Sweep)."""
    import importlib
    import pickle

    from nbtrain.common import runlog
    from nbtrain.notebook.detached import exported_job
    from nbtrain.notebook.run.choices import Choice

    for new in protocol.MOVED_MODULES.values():
        importlib.import_module(new)  # every target is a module of this nbtrain
    # An exported job's run.sh of then imports the entry by its old name.
    assert importlib.import_module("nbtrain.notebook.exported_job").main is exported_job.main
    data = pickle.dumps(Choice("ddp", "fork", {}), protocol=0)  # the module as text, no length before it
    moved = data.replace(b"nbtrain.notebook.run.choices", b"nbtrain.notebook.choices")
    assert moved != data
    path = tmp_path / "result.pkl"
    path.write_bytes(moved)
    path.chmod(0o600)
    assert runlog.read_pickle(path) == Choice("ddp", "fork", {})
