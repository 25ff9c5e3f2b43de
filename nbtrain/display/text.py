"""Plain-text renderings: GPU tables and a line-oriented progress display."""
from __future__ import annotations

import html
import os
import sys
import time
from typing import Any

from .rank_output import RankOutput
from .vitals import VitalsSampler, latest, memory_text, rate_text


def _gib(n: int | None) -> str:
    return "-" if not n else f"{n / 2**30:.1f}"


def gpu_processes_text(gpu) -> str:
    return ", ".join(f"{p.pid} {p.name} {_gib(p.memory)}G" if p.memory else f"{p.pid} {p.name}"
                     for p in gpu.processes) or "-"


def _rows(gpus) -> list[list[str]]:
    rows = []
    for g in gpus:
        index = str(g.index) if g.index == g.physical_index else f"{g.index} (phys {g.physical_index})"
        util = "-" if g.utilization is None else f"{g.utilization}%"
        memory = f"{_gib(g.memory_used)}/{_gib(g.memory_total)} GiB"
        rows.append([index, g.name, memory, util, gpu_processes_text(g)])
    return rows


HEADER = ["GPU", "name", "memory", "util", "processes (pid name mem)"]


def no_gpu_line() -> str:
    return f"no GPU visible: {os.cpu_count() or 1} CPU cores"


def gpu_table(gpus) -> str:
    if not gpus:
        return no_gpu_line()
    rows = [HEADER, *_rows(gpus)]
    widths = [max(len(r[i]) for r in rows) for i in range(len(HEADER))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows)


def memory_bar_html(used: int, total: int) -> str:
    """Used/total memory as a small inline bar with its numbers: green, amber past 50%, red past 90%."""
    fraction = min(1.0, used / total) if total else 0.0
    colour = "#43a047" if fraction < 0.5 else "#fb8c00" if fraction < 0.9 else "#e53935"
    bar = (f'<span style="display:inline-block;width:6em;height:0.7em;background:#e0e0e0;vertical-align:middle">'
           f'<span style="display:block;width:{fraction * 100:.0f}%;height:100%;background:{colour}"></span></span>')
    return f"{bar} {used / 2**30:.1f}/{total / 2**30:.1f} GiB"


def gpu_table_html(gpus) -> str:
    if not gpus:
        return f"<p>{html.escape(no_gpu_line())}</p>"
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
    rows = []
    for g, r in zip(gpus, _rows(gpus)):
        cells = [html.escape(c) for c in r]
        cells[2] = memory_bar_html(g.memory_used, g.memory_total)
        rows.append("<tr>" + "".join(f"<td style='text-align:left'>{c}</td>" for c in cells) + "</tr>")
    return f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


# -- run progress --------------------------------------------------------------------------

def fraction_text(n: int, total: int | None) -> str:
    return f"{n}/{total}" if total is not None else str(n)


def metric_values_text(metrics: dict) -> str:
    return " ".join(f"{name}={m.value:.4g}" for name, m in metrics.items())


def _clip(text: str, width: int = 80) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


def rank_line(view, state=None, final: bool = False, vital=None) -> str:
    """One line for one rank: status, every progress level, step rate, memory, latest metrics."""
    status, detail, reason = state.outcome(view.rank, final) if state is not None else (view.status, view.detail, "")
    if detail.startswith(status):  # "stopped (rank 1 failed)" says the status and why
        status, detail = detail, ""
    bars = " ".join(f"{b.desc} {fraction_text(b.n, b.total)}" for _, b in sorted(view.bars.items()))
    rate = view.step_rate if final or vital is None else vital.step_rate
    parts = [f"rank {view.rank}", status, bars, rate_text(rate, None if final else view), memory_text(vital),
             metric_values_text(view.metrics),
             detail, _clip(reason.splitlines()[0]) if reason else ""]  # its first line; a stack may follow
    return "  ".join(p for p in parts if p)


def batch_text(state, times: str = "x") -> str:
    if not state.effective_batch_size:
        return ""
    per, n = state.per_rank_batch_size, len(state.ranks)
    split = f" ({per} per rank {times} {state.effective_batch_size // per} ranks)" if n > 1 and per else ""
    return f"effective batch size {state.effective_batch_size}{split}"


def summary_lines(state, ok: bool) -> list[str]:
    head = f"nbtrain: {state.title}: {state.verdict(ok)} in {state.elapsed:.2f} s"
    batch = batch_text(state)
    head += f"; {batch}" if batch else ""
    vitals = latest(state)
    return [head, *("  " + rank_line(v, state, True, vitals.get(r)) for r, v in state.ranks.items()),
            *state.doctor_lines()]


def _sends_in_batches(stream) -> bool:
    """A kernel's stream sends what it holds every 0.2 s, and before any display: flushing it
    per line made one message per line (10,000 lines: 10,029 messages), and past the iopub
    socket's high-water mark ZeroMQ drops messages, so a busy rank's lines were lost."""
    return type(stream).__module__.startswith("ipykernel")


class QuietDisplay:
    """progress=False: no bars, no summary; the ranks' own output is still shown.

    Besides the five methods every display has, `live` and `rich` show the lines a rank's bar
    redraws and its rich display (`rank_output.RankOutput`); every display here inherits them.
    """

    def __init__(self, file=None):
        self._file = file
        self._said = ""  # the latest note
        self.vitals = VitalsSampler()  # every display samples them, so Result.vitals is always kept
        self._rank_output: RankOutput | None = None

    @property
    def rank_output(self) -> RankOutput:
        """Made on first use: a display of the caller's own may subclass this without calling __init__."""
        made = self.__dict__.get("_rank_output")
        if made is None:
            made = self._rank_output = RankOutput(self.output, self._shown_again)
        return made

    def _write(self, text: str, stream: str = "stdout") -> None:
        target = self._file or (sys.stderr if stream == "stderr" else sys.stdout)
        if self._file is None and stream != self.__dict__.get("_stream", stream):
            # The kernel batches each stream apart: what the other one holds goes first, so the
            # cell shows a rank's stdout and stderr lines in the order the rank wrote them.
            (sys.stdout if stream == "stderr" else sys.stderr).flush()
        self._stream = stream
        print(text, file=target, flush=not _sends_in_batches(target))

    def start(self, state) -> None:
        self.rank_output.start(state)

    def note(self, text: str) -> None:
        self._said = text
        self._write(f"nbtrain: {text}")

    def output(self, rank, stream: str, text: str) -> None:
        self._write(text if rank is None else f"[rank {rank}] {text}", stream)
        self.rank_output.line(rank, stream, text)  # its rank's tab too (Jupyter)

    def live(self, rank, stream: str, text: str, done: bool) -> None:
        self.rank_output.live(rank, stream, text, done)

    def rich(self, message) -> None:
        self.rank_output.rich(message)

    def update(self, state) -> None:
        self.vitals.maybe_sample(state)
        self.rank_output.tick()  # the ranks' tabs (Jupyter)

    def finish(self, state, ok: bool) -> None:
        self._end_rank_output()

    def _end_rank_output(self) -> None:
        said = self.rank_output.end()
        if said:
            self.note(said)

    def _shown_again(self) -> None:
        """A rank cleared the cell's output: what this display must show again (nothing here)."""


class LineDisplay(QuietDisplay):
    """Progress as whole lines every few seconds: readable in logs, CI and saved notebooks."""

    def __init__(self, file=None, interval: float = 5.0):
        super().__init__(file)
        self.interval = interval
        self._last = 0.0

    def start(self, state) -> None:
        self.rank_output.start(state)
        self._last = time.monotonic()
        if not self._said.startswith(state.title):  # launch's note on what 'auto' chose said it already
            self._write(f"nbtrain: {state.title}")

    def update(self, state) -> None:
        self.vitals.maybe_sample(state)
        self.rank_output.tick()  # the ranks' tabs (Jupyter)
        now = time.monotonic()
        if now - self._last >= self.interval:
            self._last = now
            vitals = latest(state)
            for rank, view in state.ranks.items():
                self._write("  " + rank_line(view, vital=vitals.get(rank)))

    def finish(self, state, ok: bool) -> None:
        for line in summary_lines(state, ok):
            self._write(line)
        self._end_rank_output()


class TqdmDisplay(LineDisplay):
    """A terminal: one live tqdm bar per rank; output lines are written above the bars."""

    def __init__(self, file=None, interval: float = 0.1):
        super().__init__(file or sys.stderr, interval)
        self._bars: dict[int, Any] = {}
        self._seen = -1

    def _write(self, text: str, stream: str = "stdout") -> None:
        from tqdm import tqdm

        tqdm.write(text, file=self._file)

    def update(self, state) -> None:
        self.vitals.maybe_sample(state)
        self.rank_output.tick()  # the ranks' tabs (Jupyter)
        now = time.monotonic()
        if state.version == self._seen or now - self._last < self.interval:
            return
        self._last, self._seen = now, state.version
        from tqdm import tqdm

        for rank, view in state.ranks.items():
            bar = self._bars.get(rank)
            if bar is None:
                bar = self._bars[rank] = tqdm(total=None, position=len(self._bars), file=self._file,
                                              leave=False, dynamic_ncols=True, mininterval=0)
            levels = sorted(view.bars.items())
            inner = levels[-1][1] if levels else None
            outer = " ".join(f"{b.desc} {fraction_text(b.n, b.total)}" for _, b in levels[:-1])
            bar.total = inner.total if inner else None
            bar.n = inner.n if inner else 0
            # tqdm's rate counts from it: a resumed loop's earlier steps were not done now
            bar.initial = inner.initial if inner else 0
            bar.set_description_str(" ".join(p for p in (f"rank {rank}", outer, inner.desc if inner else view.status)
                                             if p),
                                    refresh=False)
            bar.set_postfix_str(metric_values_text(view.metrics), refresh=False)
            bar.refresh()

    def finish(self, state, ok: bool) -> None:
        for bar in self._bars.values():
            bar.close()
        if self._bars:  # a closed bar below the first moves the cursor up but leaves it at the line's end
            self._file.write("\r")
        self._bars.clear()
        super().finish(state, ok)
