"""What showing rank output as the notebook would costs, per update and once.

- Notebook side: replaying a rank's stream with `lines.Screen` (what the output pump does for
  every chunk it reads), per tqdm-style redraw and per plain line, beside splitting on newlines
  (what the pump did before).
- Rank side: a `display()` and a `handle.update()` through the channel publisher (a real Hub and
  Link in this process), and, once per rank that imports IPython and has no shell, importing
  IPython and making the plain shell (a fresh interpreter each run).

    python benchmarks/rank_output.py [--updates 20000] [--repeats 7]
"""
from __future__ import annotations

import argparse
import queue
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, record, table  # noqa: E402
from nbtrain.common.channel import Hub  # noqa: E402
from nbtrain.common.channel_link import Link  # noqa: E402
from nbtrain.common.lines import Screen  # noqa: E402

BAR = "train:  42%|████▏     | 21/50 [00:01<00:01, 19.53it/s, loss=0.123]"
LINE = "epoch 3 step 120 loss 0.1234 lr 0.001 grad-norm 1.52"

SHELL = """
import time
t = time.perf_counter()
import IPython
imported = time.perf_counter()
import types
from traitlets.config import Config
c = Config(); c.HistoryManager.enabled = False
IPython.core.interactiveshell.InteractiveShell.instance(config=c, user_module=types.ModuleType("m"))
print(imported - t, time.perf_counter() - imported)
"""


def per_chunk(chunks: list[bytes], feed) -> float:
    started = time.perf_counter()
    for chunk in chunks:
        feed(chunk)
    return (time.perf_counter() - started) / len(chunks)


def old_split():
    partial = [b""]

    def feed(chunk: bytes) -> None:
        lines = (partial[0] + chunk).split(b"\n")
        partial[0] = lines.pop()
        for line in lines:
            line.decode(errors="replace").rstrip("\r")

    return feed


def publisher_costs(updates: int) -> tuple[float, float]:
    from IPython.display import HTML, display

    from nbtrain.rank.output import _publish_through

    inbox: queue.Queue = queue.Queue()
    hub = Hub(inbox)
    hub.start()
    link = Link(0, hub.environ)
    _publish_through(link)
    try:
        started = time.perf_counter()
        handles = [display(HTML(f"<b>{i}</b>"), display_id=True) for i in range(updates)]
        shown = (time.perf_counter() - started) / updates
        started = time.perf_counter()
        for i, handle in enumerate(handles):
            handle.update(HTML(f"<i>{i}</i>"))
        updated = (time.perf_counter() - started) / updates
    finally:
        link.close()
        hub.close()
    return shown, updated


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--updates", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    bars = [f"\r{BAR}".encode()] * args.updates
    lines = [f"{LINE}\n".encode()] * args.updates
    runs: dict[str, list[float]] = {k: [] for k in ("bar new", "bar old", "line new", "line old", "import", "shell")}
    for _ in range(args.repeats):  # interleaved
        runs["bar new"].append(per_chunk(bars, Screen().feed))
        runs["bar old"].append(per_chunk(bars, old_split()))
        runs["line new"].append(per_chunk(lines, Screen().feed))
        runs["line old"].append(per_chunk(lines, old_split()))
        out = subprocess.run([sys.executable, "-c", SHELL], capture_output=True, text=True, check=True).stdout
        imported, shell = map(float, out.split())
        runs["import"].append(imported)
        runs["shell"].append(shell)
    shown, updated = publisher_costs(min(args.updates, 5000))
    us = lambda key: f"{median(runs[key]) * 1e6:.1f}"  # noqa: E731
    rows = [
        ["notebook: a tqdm redraw replayed (one chunk each)", us("bar new"),
         f"{us('bar old')} (split on newlines: every redraw kept until the bar's newline, a cost growing with it)"],
        ["notebook: a plain line replayed (one chunk each)", us("line new"), f"{us('line old')} (split on newlines)"],
        ["rank: display(HTML(...), display_id=True) to the channel", f"{shown * 1e6:.1f}", "-"],
        ["rank: handle.update(HTML(...)) to the channel", f"{updated * 1e6:.1f}", "-"],
        ["rank, once, only if it imports IPython: import IPython", f"{median(runs['import']) * 1e3:.0f} ms", "-"],
        ["rank, once, only if it imports IPython and has no shell: the plain shell",
         f"{median(runs['shell']) * 1e3:.0f} ms", "-"],
    ]
    record("Rank output (rank_output.py)", f"""
{args.updates} updates per run, median of {args.repeats} interleaved runs (the shell: a fresh interpreter each run).

{table(["what", "µs per update (or once)", "before"], rows)}

The replay runs on the notebook's output thread, never in a rank; a rank's own output path (its
pipes) is unchanged. tqdm redraws at most 10 times a second by default, so a bar costs the
notebook well under a millisecond a second per rank, plus one display update message.
""")


if __name__ == "__main__":
    main()
