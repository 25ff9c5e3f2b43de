"""`Result.profile`: the ranks' profile summaries as one table, and the slowest rank in words.

Each rank measured itself (`rank/profiling.py`); here they are only compared and shown: HTML in
a notebook, text elsewhere.
"""
from __future__ import annotations

import html

from ..common.tracebacks import place_name

WORDS = {"communication": "waiting in {collective}", "data": "loading data", "compute": "computing",
         "idle": "idle (in no operator: Python code, sleeps, I/O)"}
# A rank waiting this much less of its step in collectives than another is the one they wait for
# (a share of the step: tiny CPU steps differ by 10 points from run to run with no straggler).
WAIT_GAP = 0.25
SPREAD = 0.20  # time outside collectives this much longer than the others' (median): that rank is slower
OUTSIDE = 0.5  # a step at least this much idle or loading data is told by the user's lines, not operators


class ProfileTable:
    """One row per rank: step time, its split (communication, data, compute, idle), top operators
    (or, for a step mostly in no operator, the user's lines where it went)."""

    def __init__(self, summaries: dict[int, dict]):
        self.summaries = dict(sorted(summaries.items()))

    @property
    def ranks(self) -> dict[int, dict]:
        """The ranks that profiled a step."""
        return {r: s for r, s in self.summaries.items() if s.get("steps")}

    def traces(self) -> dict[int, str]:
        """Each rank's Chrome trace file (open in ui.perfetto.dev or TensorBoard's profiler)."""
        return {r: s["trace"] for r, s in self.summaries.items() if s.get("trace")}

    def share(self, rank: int, category: str) -> float:
        summary = self.ranks[rank]
        return summary["split"][category] / summary["step_time"] if summary["step_time"] else 0.0

    def busy(self, rank: int) -> float:
        """Seconds of its step a rank spends outside collectives: what the others wait for."""
        summary = self.ranks[rank]
        return summary["step_time"] - summary["split"].get("communication", 0.0)

    def slowest(self) -> int | None:
        """The rank the others wait for, by the doctor's rule (`notebook/run/doctor.py`'s straggler):
        the one with the most time outside collectives in its step; never the one with the
        longer step because it waited longer."""
        ranks = self.ranks
        return max(ranks, key=self.busy) if ranks else None

    def verdict(self) -> str:
        """The slowest rank and why, in words: "slowest: rank 1, 25 ms per step, 81 % idle (...);
        rank 0 waits for it: 95 % waiting in gloo:all_reduce"; or that no rank stands out."""
        slow = self.slowest()
        if slow is None:
            notes = [s.get("note", "") for s in self.summaries.values()]
            return "no rank profiled a step" + (f": {notes[0]}" if notes and notes[0] else "")
        ranks = self.ranks
        step = f"{_ms(ranks[slow]['step_time'])} per step, {self._main(slow)}"
        if len(ranks) == 1:
            return f"rank {slow}: {step}"
        others = sorted(self.busy(r) for r in ranks if r != slow)
        ratio = self.busy(slow) / max(others[len(others) // 2], 1e-12)
        waiting = max(ranks, key=lambda r: self.share(r, "communication"))
        if ratio >= 1 + SPREAD or self.share(waiting, "communication") - self.share(slow, "communication") >= WAIT_GAP:
            waits = f"; rank {waiting} waits for it: {self._part(waiting, 'communication')}" if waiting != slow else ""
            return f"slowest: rank {slow}, {step}{waits}"
        times = [s["step_time"] for s in ranks.values()]
        return f"no rank stands out (steps of {_ms(min(times))} to {_ms(max(times))}); rank {slow}: {step}"

    def _main(self, rank: int) -> str:
        split = self.ranks[rank]["split"]
        main = max(split, key=split.get)
        frames = self.frames(rank)
        where = f", at {frames[0][0]}" if main in ("idle", "data") and frames else ""
        return self._part(rank, main) + where

    def frames(self, rank: int) -> list[tuple[str, float]]:
        """Where in the user's code a rank's step went while in no operator, most first, as
        ("train.py:12 load()", seconds per step), when that is most of its step; else none."""
        if self.share(rank, "idle") + self.share(rank, "data") < OUTSIDE:
            return []
        return [(_place(file, line, function), seconds)
                for file, line, function, seconds in self.ranks[rank].get("frames", ())]

    def _part(self, rank: int, category: str) -> str:
        collective = self.ranks[rank].get("collective") or "collectives"
        return f"{self.share(rank, category):.0%} {WORDS[category].format(collective=collective)}".replace("%", " %", 1)

    def rows(self) -> list[list[str]]:
        head = ["rank", "step", "communication", "data", "compute", "idle", "top operators"]
        rows = [head]
        for rank, summary in self.summaries.items():
            if not summary.get("steps"):
                rows.append([str(rank), "", "", "", "", "", summary.get("note", "")])
                continue
            shares = [f"{self.share(rank, c):.0%}" for c in ("communication", "data", "compute", "idle")]
            frames = self.frames(rank)
            named = frames or summary["top"]
            top = ("outside operators: " if frames else "") + ", ".join(
                f"{name} {_ms(seconds)}" for name, seconds in named[:3])
            rows.append([str(rank), _ms(summary["step_time"]), *shares, top])
        return rows

    def __repr__(self) -> str:
        rows = self.rows()
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = ["  ".join(cell.ljust(w) for cell, w in zip(r, widths)) + "  " + r[-1] for r in rows]
        return "\n".join([f"Profile of {len(self.summaries)} ranks: {self.verdict()}", *lines])

    def _repr_html_(self) -> str:
        rows = self.rows()
        slow = self.slowest()
        head = "".join(f"<th style='text-align:left'>{html.escape(c)}</th>" for c in rows[0])
        body = "".join(
            "<tr" + (" style='font-weight:bold'" if r[0] == str(slow) else "") + ">"
            + "".join(f"<td style='text-align:left'>{html.escape(c)}</td>" for c in r) + "</tr>" for r in rows[1:])
        return (f'<div class="nbtrain-profile"><div><b>nbtrain profile</b> · {html.escape(self.verdict())}</div>'
                f"<table><tr>{head}</tr>{body}</table></div>")


def _place(file: str, line: int, function: str) -> str:
    """'train.py:12 load()', 'In[3]:7' for a cell's own lines (IPython's name, in the kernel)."""
    where = f"{place_name(file)}:{line}"
    return where if function.startswith("<") else f"{where} {function}()"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:.3g} ms"
