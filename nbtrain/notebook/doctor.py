"""The doctor's verdicts, in one place and in words: who waits, where, for whom.

Pure functions of what the ranks sent (`rank/doctor.py`: `Whereabouts` when asked, `StepTimes`
with each reply); the supervisor asks, the run's model keeps the answers, `Result` and the views
show them. Blame goes to the rank the others wait for, never to the one that waited.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from ..common.tracebacks import place_name

DEFAULT_STALL = 60.0  # seconds without progress on any rank before a run is called stalled...
STALL_STEPS = 10  # ...or this many of its recent steps, if longer
SLOWER = 1.3  # a rank this much busier than the others' median is a straggler
CODE_WIDTH = 60  # characters of a rank's line of code quoted in a verdict
DATA_HEAVY = 0.3  # ...and its step is "waiting for data" when that is this much more of it than of the others'


def stall_after(stall, step_time: float | None) -> float | None:
    """Seconds without progress that make a stall: `stall` as given (None: the default, False or 0: never)."""
    if stall is None:
        return max(DEFAULT_STALL, STALL_STEPS * step_time) if step_time else DEFAULT_STALL
    return float(stall) if stall else None


def check_stall(stall):
    """`stall=` as given, once it is None, False or a positive number of seconds."""
    if stall is None or stall is False or (not isinstance(stall, bool) and isinstance(stall, (int, float))
                                          and stall > 0):
        return stall
    raise ValueError(f"stall={stall!r}: give a positive number of seconds without progress, None for the default "
                     f"(max({DEFAULT_STALL:g} s, {STALL_STEPS}x the recent step time)), or False to never check.")


def call_words(call) -> str:
    """'all_reduce #2 (float32[3, 4]) at train.py:5' for a counted collective (seq, op, shape, dtype, file, line)."""
    seq, op, shape, dtype, file, line = call
    tensor = f" ({dtype}[{', '.join(map(str, shape))}])" if shape is not None else ""
    return f"{op} #{seq}{tensor} at {place_name(file)}:{line}"


def _at(where) -> str:
    place = f"{place_name(where.file)}:{where.line}" if where.file else "an unknown place"
    code = where.code if len(where.code) <= CODE_WIDTH else where.code[:CODE_WIDTH - 3] + "..."
    return f"{place} ({code})" if code else place


@dataclass
class Verdict:
    """A stall's diagnosis: the words, and the ranks the others wait for (the blame)."""
    text: str
    culprits: list[int]
    waiting: list[int]


def stall_verdict(where: dict, silent: list[int] | tuple[int, ...] = ()) -> Verdict:
    """Where each rank is (`protocol.Whereabouts` by rank), and the ranks that did not answer
    (their main thread holds the GIL in C code): who waits in which collective, for whom."""
    meeting = {r: w.rendezvous for r, w in where.items() if w.rendezvous}
    if meeting:
        return _rendezvous_verdict(where, meeting, silent)
    waiting = sorted(r for r, w in where.items() if w.current is not None)
    free = sorted(r for r, w in where.items() if w.current is None)
    parts = [f"rank {r} waits in {_in_collective(where[r])}" for r in waiting]
    parts += [f"rank {r} is not in a collective: at {_at(where[r])}" for r in free]
    parts += [f"rank {r} did not say where it is (busy in C code that holds the GIL)" for r in sorted(silent)]
    text = "; ".join(parts)
    mismatch = _current_mismatch({r: where[r].current for r in waiting})
    if mismatch:
        return Verdict(f"{text}. {mismatch}", [], waiting)
    culprits = free + sorted(silent)
    if waiting and culprits:
        who = _ranks(culprits)
        return Verdict(f"{text}. The others wait for {who}.", culprits, waiting)
    if waiting:  # everyone in a collective, the same one: the backend itself is stuck (a lost peer, a network)
        return Verdict(f"{text}. Every rank is in the same collective and none returns: the backend is stuck "
                       "(a lost connection, a device that hangs).", [], waiting)
    return Verdict(f"{text}. No rank is in a collective.", culprits, [])


def _rendezvous_verdict(where: dict, meeting: dict, silent) -> Verdict:
    """Ranks whose init_process_group has not completed: where each waits, and who should host it."""
    parts = [f"rank {r} waits to join the process group at {url} ({_host(url, r)}), at {_at(where[r])}"
             for r, url in sorted(meeting.items())]
    joined = sorted(r for r in where if r not in meeting)
    parts += [f"rank {r} is not joining: at {_at(where[r])}" for r in joined]
    parts += [f"rank {r} did not say where it is" for r in sorted(silent)]
    text = "; ".join(parts)
    if joined or silent:  # the ones that never came to the rendezvous are the ones waited for
        who = sorted(joined) + sorted(silent)
        return Verdict(f"{text}. The others wait for {_ranks(who)} to join.", who, sorted(meeting))
    if len(set(meeting.values())) > 1:
        return Verdict(f"{text}. The ranks wait at different addresses: give every rank the same init_method "
                       "(or none: nbtrain's ranks join their group without one).", sorted(meeting), [])
    return Verdict(f"{text}. Nobody they can reach hosts it: check the address and port (or give no init_method: "
                   "nbtrain's ranks join their group without one).", sorted(meeting), [])


def _host(url: str, rank: int) -> str:
    if url.startswith("tcp://"):
        return "hosting it" if rank == 0 else "rank 0 should host it"
    if url.startswith("env://"):
        return "the launch's private store"
    return "a store every rank must reach"


def _in_collective(where) -> str:
    seq, op, shape, dtype, file, line = where.current
    return call_words(where.current) if where.file == file and where.line == line \
        else f"{call_words(where.current)} (from {_at(where)})"


def _ranks(ranks: list[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(map(str, ranks))


def _current_mismatch(calls: dict) -> str | None:
    """Ranks in collectives that cannot meet: different sequence numbers, ops, shapes or dtypes."""
    if len(calls) < 2:
        return None
    if len({c[0] for c in calls.values()}) > 1:
        return ("The ranks are at different collectives: a rank skipped one, or called one more, than the others "
                "(every rank must call the same collectives in the same order).")
    return mismatch({r: [c] for r, c in calls.items()})


def mismatch(recent: dict) -> str | None:
    """The first collective where ranks disagree (op, shape or dtype at the same sequence number),
    in one sentence naming each rank's call; None when their recent collectives agree."""
    by_seq: dict[int, dict[int, tuple]] = {}
    for rank, calls in recent.items():
        for call in calls:
            by_seq.setdefault(call[0], {})[rank] = call
    for seq in sorted(by_seq):
        calls = by_seq[seq]
        if len(calls) < 2 or len({c[1:4] for c in calls.values()}) == 1:
            continue
        ops = {c[1] for c in calls.values()}
        what = ("ops" if len(ops) > 1 else "shapes" if len({c[2] for c in calls.values()}) > 1 else "dtypes")
        each = "; ".join(f"rank {r}: {call_words(c)}" for r, c in sorted(calls.items()))
        return f"Collective #{seq} does not match across ranks (different {what}): {each}."
    return None


def straggler(times: dict) -> str | None:
    """'rank 1 is 1.9x slower than the others: 70 % of its step waiting for data', from each
    rank's `protocol.StepTimes`; None when no rank stands out (or fewer than two reported)."""
    if len(times) < 2 or any(t.batches < 2 for t in times.values()):
        return None  # a step is a batch of ctx.loader's: without them there is no step to compare
    busy = {r: max(t.total - t.collective, 1e-9) for r, t in times.items()}
    slow = max(busy, key=busy.__getitem__)
    others = [busy[r] for r in busy if r != slow]
    ratio = busy[slow] / median(others)
    t = times[slow]
    data = t.data / t.total if t.total > 0 else 0.0
    others_data = median(times[r].data / times[r].total if times[r].total > 0 else 0.0 for r in times if r != slow)
    if ratio >= SLOWER:
        cause = (f"{data:.0%} of its step waiting for data" if data - others_data >= DATA_HEAVY
                 else f"{1 - data - t.collective / max(t.total, 1e-9):.0%} of its step computing")
        return f"rank {slow} is {ratio:.1f}x slower than the others: {cause.replace('%', ' %')}"
    fed = max(times, key=lambda r: times[r].data / times[r].total if times[r].total > 0 else 0.0)
    share = times[fed].data / times[fed].total if times[fed].total > 0 else 0.0
    rest = median(times[r].data / times[r].total if times[r].total > 0 else 0.0 for r in times if r != fed)
    if share - rest >= DATA_HEAVY:
        return (f"rank {fed} spends {share:.0%} of its time waiting for data (the others {rest:.0%})"
                .replace("%", " %"))
    return None


def split_words(t) -> str:
    """One rank's split, for the summary: 'data 70 %, compute 20 %, collectives 10 %'."""
    if t.total <= 0:
        return ""
    data, coll = t.data / t.total, t.collective / t.total
    return f"data {data:.0%}, compute {max(0.0, 1 - data - coll):.0%}, collectives {coll:.0%}".replace("%", " %")
