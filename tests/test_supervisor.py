"""The supervisor's decisions, against a scripted pool that offers exactly its `Watched` interface:
a deadline, a peer's lost connection, a rank that ended while another waits, a stall, a Ctrl-C.
No process is started: each decision is checked in a second or less (the real pool's tests, with real
ranks, are in test_pool.py, test_launch.py and test_doctor.py)."""
import time
from collections import deque

import pytest

from nbtrain.common import protocol
from nbtrain.common.errors import WorkerError
from nbtrain.notebook.run import hang_checks
from nbtrain.notebook.run import supervisor as supervising
from nbtrain.notebook.run.runmodel import RunState
from nbtrain.notebook.run.supervisor import Supervisor
from nbtrain.notebook.run.watched import Watched

# A rank's main thread waiting in a collective, as faulthandler dumps it (stacks.blocked_on_peers reads it).
WAITING = ('Thread 0x00007f (most recent call first):\n'
           '  File "/usr/lib/python3/site-packages/torch/distributed/distributed_c10d.py", line 2501 in all_reduce\n'
           '  File "/home/me/train.py", line 7 in train\n')


class FakeProcess:
    """A rank process as the supervisor sees it (`placements.base`): polled, never signalled."""

    def __init__(self, rank: int):
        self.ranks, self.pid, self.exited_at, self.code = [rank], 1000 + rank, None, None

    def poll(self):
        return self.code

    def exit_reason(self, rank, code, pid):
        return f"Signal 9 (SIGKILL) received by PID {pid}", True

    def status(self):
        return None

    def engine_gone(self):
        return None

    def lost_reason(self, rank):
        return None


class ScriptedPool:
    """Every member of `Watched`; what the ranks send is scripted: `at(seconds, message)`, and the
    answers to `ask_where`, `ask_stacks` and `interrupt` are set per rank."""

    def __init__(self, ranks=(0, 1), live=False, stall=False):
        self.live, self.remote, self.stall = live, False, stall
        self.processes = tuple(FakeProcess(r) for r in ranks)
        self.ended_by = self.broken = self.restart_reason = None
        self.where: dict[int, protocol.Whereabouts] = {}
        self.stacks: dict[int, str] = {}
        self.on_interrupt: dict[int, object] = {}
        self.asked, self.stuck_ranks, self.lost_codes = [], [], []
        # No pid: a fake rank is no process py-spy could read (ranks on another machine send none either).
        self._inbox: deque = deque(protocol.Hello(r, None) for r in ranks)
        self._timed: list[tuple[float, object]] = []
        self._began = time.monotonic()
        self._closed: set[int] = set()

    def at(self, seconds: float, message) -> None:
        self._timed.append((self._began + seconds, message))

    def receive(self, timeout: float):
        now = time.monotonic()
        due = [m for t, m in self._timed if t <= now]
        self._timed = [(t, m) for t, m in self._timed if t > now]
        self._inbox.extend(due)
        if self._inbox:
            message = self._inbox.popleft()
            if isinstance(message, protocol.Closed):
                self._closed.add(message.rank)
            return message
        time.sleep(max(0.0, min(timeout, 0.005)))
        return None

    def process_of(self, rank):
        return next((p for p in self.processes if rank in p.ranks), None)

    def closed(self, rank):
        return rank in self._closed

    def output_unread(self, rank):
        return False

    def closed_ranks(self):
        return sorted(self._closed)

    def began(self, rank):
        return True

    def output_done(self, rank):
        return True

    def shows(self, output):
        return True

    def last_words(self, rank):
        return ""

    def answer(self, message, display):
        raise AssertionError("no rank in these scripts asks for names")

    def interrupt(self, ranks):
        self.asked.append(("interrupt", list(ranks)))
        self._inbox.extend(self.on_interrupt[r] for r in ranks if r in self.on_interrupt)

    def ask_stacks(self, pids):
        self.asked.append(("stacks", sorted(pids)))
        self._inbox.extend(protocol.Output(r, "stderr", line) for r in pids
                           for line in self.stacks.get(r, "").splitlines())

    def ask_where(self, ranks):
        self.asked.append(("where", list(ranks)))
        self._inbox.extend(self.where[r] for r in ranks if r in self.where)

    def lost(self, proc, code, how=None):
        self.lost_codes.append((proc.ranks, code))

    def stuck(self, ranks, why):
        self.stuck_ranks.append((list(ranks), why))

    def restart_note(self):
        return ""

    def any_alive(self):
        return any(p.code is None for p in self.processes)


class Notes:
    """A display that keeps what it was told (the supervisor's one channel to the user besides errors)."""

    def __init__(self):
        self.notes, self.lines = [], []

    def note(self, text):
        self.notes.append(text)

    def output(self, rank, stream, text):
        self.lines.append((rank, stream, text))

    def update(self, state):
        pass


def watch(pool, timeout=None, interrupt=None):
    state, display = RunState("test", [p.ranks[0] for p in pool.processes]), Notes()
    supervisor = Supervisor(pool, state, display, timeout, interrupt=interrupt)
    try:
        supervisor.run()
        return state, display, None
    except (WorkerError, KeyboardInterrupt) as error:
        return state, display, error


def test_the_scripted_pool_offers_exactly_the_watched_interface():
    declared = {name for name in dir(Watched) if not name.startswith("_")}
    missing = [name for name in declared if not hasattr(ScriptedPool(), name)]
    assert declared and not missing, missing


def test_a_deadline_blames_the_rank_the_others_wait_for_and_stops_the_rest():
    pool = ScriptedPool()
    pool.where = {0: protocol.Whereabouts(0, 3, (3, "all_reduce", (4,), "float32", "train.py", 7), "train.py", 7,
                                          "dist.all_reduce(x)", 0.4),
                  1: protocol.Whereabouts(1, 2, None, "train.py", 5, "time.sleep(100)", 0.4)}
    pool.stacks = {0: WAITING, 1: 'Thread 0x1 (most recent call first):\n  File "/home/me/train.py", line 5 in train\n'}
    state, _, error = watch(pool, timeout=0.2)
    assert isinstance(error, WorkerError) and error.rank == 1, error
    assert "timed out after 0.2 s; still running: ranks [0, 1]" in error.summary
    assert "The others wait for rank 1." in error.summary
    assert state.ranks[0].status == "stopped" and state.ranks[0].reason.startswith("waiting for rank 1 in all_reduce #3")
    assert pool.stuck_ranks and pool.stuck_ranks[0][0] == [0, 1]
    assert ("where", [0, 1]) in pool.asked


def test_a_peers_lost_connection_is_a_consequence_and_the_rank_that_died_the_cause():
    pool = ScriptedPool()
    # Rank 0's error about its lost peer comes first; rank 1's death is known only once its link closed.
    pool.at(0.0, protocol.Raised(0, "RuntimeError: Connection closed by peer [127.0.0.1]:4711", "Traceback..."))
    pool.processes[1].code = -9
    pool.at(0.1, protocol.Closed(1))
    state, _, error = watch(pool)
    assert isinstance(error, WorkerError) and error.rank == 1
    assert error.summary == "Signal 9 (SIGKILL) received by PID 1001"
    assert error.others == ("rank 0: stopped after rank 1 failed (RuntimeError: Connection closed by peer "
                            "[127.0.0.1]:4711)",)
    assert pool.lost_codes == [([1], -9)]


def test_a_rank_that_ended_while_another_waits_in_a_collective_is_named(monkeypatch):
    monkeypatch.setattr(hang_checks, "EARLY_EXIT_AFTER", 0.05)
    monkeypatch.setattr(hang_checks, "PROBE_INTERVAL", 0.05)
    pool = ScriptedPool()
    pool.stacks = {1: WAITING}
    pool.at(0.01, protocol.Finished(0, "train.py:9"))
    state, _, error = watch(pool)
    assert isinstance(error, WorkerError) and error.rank == 0
    assert error.summary.startswith("rank 0 ended (train.py:9) while the others still needed it: rank 1 waits for "
                                    "it in all_reduce (train.py line 7 in train). That wait can never complete.")
    assert state.ranks[1].status == "stopped"
    assert pool.stuck_ranks[0][0] == [1]


def test_a_stall_is_said_once_with_the_verdict_and_the_run_goes_on():
    pool = ScriptedPool(stall=0.1)
    pool.where = {0: protocol.Whereabouts(0, 3, (3, "all_reduce", (4,), "float32", "train.py", 7), "train.py", 7,
                                          "dist.all_reduce(x)", 5.0),
                  1: protocol.Whereabouts(1, 2, None, "train.py", 5, "batch = next(it)", 5.0)}
    pool.at(0.6, protocol.Finished(0, ""))
    pool.at(0.6, protocol.Finished(1, ""))
    state, display, error = watch(pool)
    assert error is None and state.unfinished() == []
    said = [n for n in display.notes if n.startswith("No rank has progressed")]
    assert len(said) == 1, display.notes
    assert ("No rank has progressed for 5 s: rank 0 waits in all_reduce #3 (float32[4]) at train.py:7; rank 1 is "
            "not in a collective: at train.py:5 (batch = next(it)). The others wait for rank 1.") in said[0]


def test_ranks_stopped_before_their_own_error_came_read_as_waiting_where_the_doctor_saw_them():
    # At 8 ranks on a loaded machine a waiting rank may be stopped before its "connection closed" comes:
    # its line says where the stall's probe found it, merged with those whose own error said it.
    pool = ScriptedPool(ranks=(0, 1, 2), stall=0.1)
    waits = (3, "all_reduce", (4,), "float32", "train.py", 7)
    pool.where = {r: protocol.Whereabouts(r, 3, waits, "train.py", 7, "dist.all_reduce(x)", 5.0) for r in (0, 2)}
    pool.where[1] = protocol.Whereabouts(1, 2, None, "train.py", 5, "batch = next(it)", 5.0)
    pool.at(0.6, protocol.Raised(1, "ValueError: a bad batch", "Traceback..."))
    pool.at(0.6, protocol.Raised(0, "RuntimeError: Connection closed by peer [127.0.0.1]:4711", "Traceback..."))
    _, _, error = watch(pool)
    assert isinstance(error, WorkerError) and error.rank == 1, error
    assert error.others == ("ranks 0, 2: stopped after rank 1 failed (waiting for rank 1 in all_reduce #3 (float32[4]) "
                            "at train.py:7)",), error.others


def test_a_kernel_interrupt_keeps_live_ranks_that_return_and_says_where_they_were():
    pool = ScriptedPool(live=True)
    pool.on_interrupt = {r: protocol.Raised(r, "KeyboardInterrupt", f"  File \"train.py\", line {5 + r}")
                         for r in (0, 1)}
    _, _, error = watch(pool, interrupt=KeyboardInterrupt())
    assert isinstance(error, KeyboardInterrupt)
    report = error._render_traceback_()
    assert report[0] == "KeyboardInterrupt: the live ranks [0, 1] were interrupted; their state is kept."
    assert "--- rank 0 ---" in report and "--- rank 1 ---" in report
    assert pool.stuck_ranks == []


def test_a_live_rank_that_does_not_return_from_an_interrupt_is_restarted_with_its_stack(monkeypatch):
    monkeypatch.setattr(supervising, "INTERRUPT_GRACE", 0.1)
    pool = ScriptedPool(live=True)
    pool.on_interrupt = {0: protocol.Raised(0, "KeyboardInterrupt", "")}
    pool.stacks = {1: WAITING}
    _, display, error = watch(pool, interrupt=KeyboardInterrupt())
    assert isinstance(error, KeyboardInterrupt)
    assert "ranks [1] did not return, so the live ranks are restarted" in error._render_traceback_()[0]
    assert pool.stuck_ranks == [([1], "interrupted, and ranks [1] did not return")]
    assert any("all_reduce" in note for note in display.notes)


@pytest.mark.parametrize("timeout", [None, 0.05])
def test_every_rank_that_replied_ends_the_watch_at_once(timeout):
    pool = ScriptedPool()
    pool.at(0.0, protocol.Finished(0, ""))
    pool.at(0.0, protocol.Finished(1, ""))
    state, _, error = watch(pool, timeout=timeout)
    assert error is None and [v.status for v in state.ranks.values()] == ["finished", "finished"]
    assert pool.asked == []
