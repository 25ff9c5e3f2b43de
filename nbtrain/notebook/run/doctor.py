"""The doctor's verdicts, in one place and in words: who waits, where, for whom.

Pure functions of what the ranks sent (`rank/doctor.py`: `Whereabouts` when asked, `StepTimes`
with each reply); the supervisor asks, the run's model keeps the answers, `Result` and the views
show them. Blame goes to the rank the others wait for, never to the one that waited. Ranks at the
same place are said once ("ranks 0-4, 6, 7 wait in all_reduce #12 at train.py:30"), so a verdict on
many ranks stays one line per place. The classic hangs are named with their cause and their fix:
a rank that ran out of batches while the others wait in DDP's gradient all-reduce (different numbers
of batches), or, by its DDP forwards, skipped a backward(), ran one under no_sync() the others did not,
or left a parameter unused (find_unused_parameters); a rank stuck loading its next batch. On nccl,
what NCCL's Flight Recorder saw each rank issue last is said too (`recorder_words`): it sees the
collectives Python does not (DDP's, compiled code's), so a rank behind the others shows there.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median

from ...common.tracebacks import place_name
from ...common.words import ranks_words

DEFAULT_STALL = 60.0  # seconds without progress on any rank before a run is called stalled...
STALL_STEPS = 10  # ...or this many of its recent steps, if longer
SLOWER = 1.3  # a rank this much busier than the others' median is a straggler
CODE_WIDTH = 60  # characters of a rank's line of code quoted in a verdict
DATA_HEAVY = 0.3  # ...and its step is "waiting for data" when that is this much more of it than of the others'
# A straggler is said only when it is beyond noise: enough steps, and seconds lost by the others
# waiting for it (a 0.3 s run of 16 balanced batches differs by 1.3x from run to run on a busy machine).
STRAGGLER_STEPS = 8
STRAGGLER_SECONDS = 1.0
DDP_OP = "DDP's gradient all-reduce"  # rank/ddp_counting.py's op for a DDP bucket's all-reduce
UNEVEN_FIX = ("the ranks had different numbers of batches — use DistributedSampler(drop_last=True) or "
              "torch.distributed.algorithms.Join")
SKIPPED_FIX = ("a forward without its backward() leaves the others in that backward()'s all-reduce — run backward() "
               "after every training forward on every rank (skip a batch on all ranks together, or run that forward "
               "under torch.no_grad())")
NO_SYNC_FIX = ("the ranks ran no_sync() on different steps — accumulate gradients on the same steps on every rank "
               "(no_sync() around the same backward() calls)")
UNUSED_FIX = ("a parameter a rank's forward did not use gets no gradient there, so DDP never all-reduces that "
              "backward() — pass find_unused_parameters=True to DistributedDataParallel, or use every parameter in "
              "every rank's forward")
STARVED = ("its data loading is stuck (a DataLoader worker that blocks or died, a source that does not answer): "
           "its stack shows where")


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
    """'all_reduce #2 (float32[3, 4]) at train.py:5' for a counted collective (seq, op, shape, dtype, file, line);
    "DDP's gradient all-reduce of its backward() #11 at train.py:19 (bucket 0: fc.weight, fc.bias)" for a
    DDP bucket's (which also carries its backward() number, bucket index and parameters' names)."""
    seq, op, shape, dtype, file, line, *ddp = call
    at = f"at {place_name(file)}:{line}" if file else "in backward()"
    if ddp:
        backward, bucket, names = ddp[0]
        return f"{op} of its backward() #{backward} {at} (bucket {bucket}: {names})"
    tensor = f" ({dtype}[{', '.join(map(str, shape))}])" if shape is not None else ""
    return f"{op} #{seq}{tensor} {at}"


def backward_of(call) -> int | None:
    """The backward() number of a DDP bucket's call; None for any other collective."""
    return call[6][0] if call is not None and len(call) > 6 else None


def _grouped(ranks, clause) -> list[str]:
    """One clause per place: `clause(rank, many)` says what a rank (or ranks, when `many`) do;
    ranks whose clauses read the same are said together, in the order of their first rank."""
    groups: dict[str, list[int]] = {}
    for r in sorted(ranks):
        groups.setdefault(clause(r, False), []).append(r)
    return [f"{ranks_words(rs)} {clause(rs[0], len(rs) > 1)}" for rs in groups.values()]


def _at(where) -> str:
    place = f"{place_name(where.file)}:{where.line}" if where.file else "an unknown place"
    return f"{place} ({_code(where)})" if where.code else place


def _code(where) -> str:
    return where.code if len(where.code) <= CODE_WIDTH else where.code[:CODE_WIDTH - 3] + "..."


@dataclass
class Verdict:
    """A stall's diagnosis: the words, and the ranks the others wait for (the blame)."""
    text: str
    culprits: list[int]
    waiting: list[int]


def stall_verdict(where: dict, silent: list[int] | tuple[int, ...] = ()) -> Verdict:
    """Where each rank is (`protocol.Whereabouts` by rank), and the ranks that did not answer
    (their main thread holds the GIL in C code): who waits in which collective, for whom, and why
    when the cause is a classic one (different numbers of batches, a stuck data loader)."""
    meeting = {r: w.rendezvous for r, w in where.items() if w.rendezvous}
    if meeting:
        return _rendezvous_verdict(where, meeting, silent)
    waiting = sorted(r for r, w in where.items() if w.current is not None)
    free = sorted(r for r, w in where.items() if w.current is None)
    backward = max((b for r in waiting if (b := backward_of(where[r].current))), default=None)
    peers = [facts(where[r]) for r in waiting if backward_of(where[r].current)]
    causes = {r: cause for r in free if backward and where[r].backwards < backward
              and (cause := ddp_cause(facts(where[r]), where[r].backwards, where[r].doing == "left the loop", peers))}
    loading = [r for r in free if where[r].doing == "loading data"]

    def waits(r, many):
        return f"{'wait' if many else 'waits'} in {_in_collective(where[r])}"

    def elsewhere(r, many):
        w = where[r]
        if r in causes:  # "... and left the loop at", or what it did, then where it is now
            did = causes[r][0].replace(" its ", " their ") if many else causes[r][0]
            return f"{did}{'' if causes[r][1] is UNEVEN_FIX else ', now'} at {_at(w)}"
        if r in loading:
            return f"{'are' if many else 'is'} loading {'their' if many else 'its'} next batch at {_at(w)}"
        return f"{'are' if many else 'is'} not in a collective: at {_at(w)}"

    parts = _grouped(waiting, waits) + _grouped(free, elsewhere)
    if silent:
        parts.append(f"{ranks_words(silent)} did not say where {'they are' if len(silent) > 1 else 'it is'} "
                     "(busy in C code that holds the GIL)")
    text = "; ".join(parts) + recorder_words(where)
    mismatch = _current_mismatch({r: where[r].current for r in waiting})
    if mismatch:
        return Verdict(f"{text}. {mismatch}", [], waiting)
    culprits = free + sorted(silent)
    if waiting and causes and sorted(causes) == culprits:
        fixes = dict.fromkeys(fix for _, fix in causes.values())  # each once, in the ranks' order
        return Verdict(f"{text}: {'; '.join(fixes)}.", culprits, waiting)
    if waiting and culprits:
        starved = f": {STARVED}" if loading and loading == culprits else ""
        return Verdict(f"{text}. The others wait for {ranks_words(culprits)}{starved}.", culprits, waiting)
    if waiting:  # everyone in a collective, the same one: the backend itself is stuck (a lost peer, a network)
        return Verdict(f"{text}. Every rank is in the same collective and none returns: the backend is stuck "
                       "(a lost connection, a device that hangs).", [], waiting)
    return Verdict(f"{text}. No rank is in a collective.", culprits, [])


def recorder_words(where: dict) -> str:
    """' (NCCL's flight recorder: rank 0 started all_reduce #57 (Float[1024], default_pg), not completed;
    rank 1 last completed all_reduce #56 (...))' from the ranks' `Whereabouts.nccl`
    (`rank/flight_recorder.summarise`); "" when no rank sent one (not nccl)."""
    said = {r: w.nccl for r, w in where.items() if w.nccl}
    if not said:
        return ""

    def clause(r, many):
        op, seq, sizes, dtypes, group, state, pending = said[r]
        tensor = f"{dtypes[0] if dtypes else ''}[{', '.join(map(str, sizes[0]))}], " if sizes else ""
        call = f"{op} #{seq} ({tensor}{group})"
        if state == "completed":
            return f"last completed {call}"
        more = f", the last of {pending} not completed" if pending > 1 else ", not completed"
        return f"{'started' if state == 'started' else 'issued'} {call}{more}"

    return f" (NCCL's flight recorder: {'; '.join(_grouped(said, clause))})"


def facts(said) -> tuple:
    """A rank's DDP forwards (`Whereabouts.ddp`, `StepTimes.ddp`): (training forwards, under no_sync(),
    not followed by backward(), parameters without a gradient); from its all-reduced backward() calls
    when it sent none."""
    return said.ddp or (getattr(said, "backwards", 0), 0, 0, "")


def ddp_cause(own: tuple, backwards: int, left_loop: bool, peers: list[tuple]) -> tuple[str, str] | None:
    """Why a rank that all-reduced `backwards` backward() calls has not all-reduced the one the
    ranks with `peers` facts wait in: (what it did, the fix), from its DDP forwards (`facts`);
    None when they do not tell."""
    forwards, unsynced, skipped, unused = own
    if skipped > max((p[2] for p in peers), default=0):
        return (f"skipped backward() after {skipped} of its {forwards + unsynced} forwards ({backwards} all-reduced)",
                SKIPPED_FIX)
    if unsynced > max((p[1] for p in peers), default=0):
        theirs = "/".join(sorted({str(p[1]) for p in peers}))
        return (f"ran {unsynced} of its {forwards + unsynced} forwards under no_sync() (the ranks waiting: {theirs})",
                NO_SYNC_FIX)
    if forwards - skipped > backwards:
        what = f"{unused} got none" if unused else "a parameter its forward did not use got none"
        return f"ran backward() #{backwards + 1} but never all-reduced its gradients ({what})", UNUSED_FIX
    if left_loop:
        return f"ran {backwards} backward() calls and left the loop", UNEVEN_FIX
    return None


def ended_verdict(culprit: int, ended: str, waits: dict, ran: int | None, own: tuple = (),
                  peers: list | tuple = ()) -> str:
    """A rank that ended while others wait for it: where each waits, in which collective (`waits`:
    rank -> its call, or its stack's words for it, or None), and, when they wait in DDP's gradient all-reduce of a
    backward() the ended rank never all-reduced (`ran`: its all-reduced backward() calls), why: from its DDP
    forwards and the waiting ranks' (`own`, `peers`: `facts`), a skipped backward(), no_sync() or an
    unused parameter, else that the batches differed."""
    def clause(r, many):
        call = waits[r]
        said = ("(in a collective it did not report)" if call is None else
                f"in {call}" if isinstance(call, str) else f"in {call_words(call)}")
        return f"{'wait' if many else 'waits'} for it {said}"

    text = f"rank {culprit} ended ({ended}) while the others still needed it: " + "; ".join(_grouped(waits, clause))
    backward = max((b for c in waits.values() if isinstance(c, tuple) and (b := backward_of(c))), default=None)
    if backward and ran is not None and ran < backward:
        cause = ddp_cause(own, ran, False, list(peers)) if own else None
        said, fix = cause or (f"ran {ran} backward() calls", UNEVEN_FIX)
        return f"{text}; rank {culprit} {said}: {fix}."
    return f"{text}. That wait can never complete."


def _rendezvous_verdict(where: dict, meeting: dict, silent) -> Verdict:
    """Ranks whose init_process_group has not completed: where each waits, and who should host it."""
    joined = sorted(r for r in where if r not in meeting)
    parts = _grouped(meeting, lambda r, many: f"{'wait' if many else 'waits'} to join the process group at "
                     f"{meeting[r]} ({_host(meeting[r], r)}), at {_at(where[r])}")
    parts += _grouped(joined, lambda r, many: f"{'are' if many else 'is'} not joining: at {_at(where[r])}")
    if silent:
        parts.append(f"{ranks_words(silent)} did not say where {'they are' if len(silent) > 1 else 'it is'}")
    text = "; ".join(parts)
    if joined or silent:  # the ones that never came to the rendezvous are the ones waited for
        who = sorted(joined) + sorted(silent)
        return Verdict(f"{text}. The others wait for {ranks_words(who)} to join.", who, sorted(meeting))
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
    """The collective a rank waits in, and its line when the call is not on it (DDP's, an async one's
    wait), or the line does not name it (a DTensor's `full_tensor()`, an FSDP model's forward)."""
    file, line = where.current[4:6]
    if where.file != file or where.line != line:
        return f"{call_words(where.current)} (from {_at(where)})"
    if backward_of(where.current) or not where.code or where.current[1] in where.code:
        return call_words(where.current)
    return f"{call_words(where.current)} ({_code(where)})"


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
    return mismatch_words(mismatched_calls(recent))


def mismatch_words(calls: dict[int, tuple] | None) -> str | None:
    """`mismatch`'s sentence for the calls `mismatched_calls` found; None for none."""
    if calls is None:
        return None
    seq = next(iter(calls.values()))[0]
    ops = {c[1] for c in calls.values()}
    what = ("ops" if len(ops) > 1 else "shapes" if len({c[2] for c in calls.values()}) > 1 else "dtypes")
    return f"Collective #{seq} does not match across ranks (different {what}): {each_call(calls)}."


def mismatched_calls(recent: dict) -> dict[int, tuple] | None:
    """Each rank's call at the first sequence number where ranks disagree; None when they agree."""
    by_seq: dict[int, dict[int, tuple]] = {}
    for rank, calls in recent.items():
        for call in calls:
            by_seq.setdefault(call[0], {})[rank] = call
    for seq in sorted(by_seq):
        calls = by_seq[seq]
        if len(calls) >= 2 and len({c[1:4] for c in calls.values()}) > 1:
            return calls
    return None


def each_call(calls: dict) -> str:
    """'ranks 0-6: all_reduce #2 (float32[3]) at train.py:5; rank 7: ...': ranks whose calls read the
    same said together."""
    words: dict[str, list[int]] = {}
    for rank, call in sorted(calls.items()):
        words.setdefault(call_words(call), []).append(rank)
    return "; ".join(f"{ranks_words(ranks)}: {said}" for said, ranks in words.items())


def straggler(times: dict) -> str | None:
    """'rank 1 is 1.9x slower than the others: 70 % of its step waiting for data (more DataLoader workers,
    num_workers=, or a faster source)', from each rank's `protocol.StepTimes`; None when no rank stands
    out beyond noise: fewer than STRAGGLER_STEPS steps, or less than STRAGGLER_SECONDS lost to it."""
    if len(times) < 2 or any(t.batches < STRAGGLER_STEPS for t in times.values()):
        return None  # a step is a batch of ctx.loader's: too few of them say nothing beyond noise
    busy = {r: max(t.total - t.collective, 1e-9) for r, t in times.items()}
    slow = max(busy, key=busy.__getitem__)
    others = [busy[r] for r in busy if r != slow]
    ratio = busy[slow] / median(others)
    t = times[slow]
    data = t.data / t.total if t.total > 0 else 0.0
    others_data = median(times[r].data / times[r].total if times[r].total > 0 else 0.0 for r in times if r != slow)
    if ratio >= SLOWER and busy[slow] - median(others) >= STRAGGLER_SECONDS:
        cause = (f"{data:.0%} of its step waiting for data (more DataLoader workers, num_workers=, or a faster "
                 "source)" if data - others_data >= DATA_HEAVY else
                 f"{1 - data - t.collective / max(t.total, 1e-9):.0%} of its step computing (a slower or busier "
                 "device, or more work in its batches: compare their sizes)")
        return f"rank {slow} is {ratio:.1f}x slower than the others: {cause.replace('%', ' %', 1)}"
    share = {r: times[r].data / times[r].total if times[r].total > 0 else 0.0 for r in times}
    fed = max(share, key=share.__getitem__)
    rest = median(share[r] for r in times if r != fed)
    if share[fed] - rest >= DATA_HEAVY and (share[fed] - rest) * times[fed].total >= STRAGGLER_SECONDS:
        return (f"rank {fed} spends {share[fed]:.0%} of its time waiting for data (the others {rest:.0%}): more "
                "DataLoader workers (num_workers=) or a faster source").replace("%", " %")
    return None


def split_words(t) -> str:
    """One rank's split, for the summary: 'data 70 %, compute 20 %, collectives 10 %'."""
    if t.total <= 0:
        return ""
    data, coll = t.data / t.total, t.collective / t.total
    return f"data {data:.0%}, compute {max(0.0, 1 - data - coll):.0%}, collectives {coll:.0%}".replace("%", " %")
