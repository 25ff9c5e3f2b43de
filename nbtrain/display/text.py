"""Plain-text renderings: GPU tables and a line-oriented progress display."""
from __future__ import annotations

import html
import os


def _gib(n: int | None) -> str:
    return "-" if not n else f"{n / 2**30:.1f}"


def _processes(gpu) -> str:
    return ", ".join(f"{p.pid} {p.name} {_gib(p.memory)}G" if p.memory else f"{p.pid} {p.name}"
                     for p in gpu.processes) or "-"


def _rows(gpus) -> list[list[str]]:
    rows = []
    for g in gpus:
        index = str(g.index) if g.index == g.physical_index else f"{g.index} (phys {g.physical_index})"
        util = "-" if g.utilization is None else f"{g.utilization}%"
        memory = f"{_gib(g.memory_used)}/{_gib(g.memory_total)} GiB"
        rows.append([index, g.name, memory, util, _processes(g)])
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


def gpu_table_html(gpus) -> str:
    if not gpus:
        return f"<p>{html.escape(no_gpu_line())}</p>"
    head = "".join(f"<th>{html.escape(h)}</th>" for h in HEADER)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in r) + "</tr>" for r in _rows(gpus))
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"
