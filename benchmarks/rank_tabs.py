"""What each rank's live tab costs the notebook, per output line, in a real Jupyter kernel.

The display a `%%ranks` cell uses (`LazyDisplay`, quiet until a bar) is handed `lines` printed
lines from 2 ranks, with an `update` every 10 lines as the supervisor's loop calls it; the tabs
(`display/rank_tabs.py`) then keep each line per rank and redraw the changed panes at most every
0.25 s (ipywidgets messages really sent), and the command's end replaces them with the static
summary. Timed from `start` to `finish`, median of `--repeats`, for many lines and for just
enough to show the tabs (their fixed cost). `--before DIR` times
another checkout too (`git archive <commit> | tar -x -C DIR`), in a second kernel, interleaved.

    python benchmarks/rank_tabs.py [--lines 20000] [--repeats 7] [--before DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Kernel, median, record, table  # noqa: E402

SHORT = 12  # just past the lines that show the tabs: their fixed cost (widgets made, the summary, closed)
SETUP = '''
import os, sys, time
from nbtrain.common.protocol import Hello
from nbtrain.display.lazy import LazyDisplay
from nbtrain.notebook.run.runmodel import RunState
LINE = "epoch 3 step 120 loss 0.1234 lr 0.001 grad-norm 1.52"

def timed(lines):
    state = RunState("exec on live ranks [0, 1]", [0, 1])
    for rank in (0, 1):
        state.handle(Hello(rank, os.getpid()))
    display = LazyDisplay()
    t = time.perf_counter()
    display.start(state)
    for i in range(lines):
        display.output(i % 2, "stdout", LINE)
        if i % 10 == 9:
            display.update(state)
    display.finish(state, True)
    sys.stdout.flush()
    return time.perf_counter() - t
timed(2000)  # warm: ipywidgets imported, the first widgets made
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=20000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--before", help="another checkout of nbtrain: timed too, in a second kernel")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    kernels = {"": Kernel()}
    try:
        if args.before:
            path = os.path.abspath(args.before)
            kernels[" (before)"] = Kernel(cwd=path, env={**os.environ, "PYTHONPATH": path})
        for kernel in kernels.values():
            kernel.run(SETUP)
        times: dict[tuple, list[float]] = {}
        for _ in range(args.repeats):
            for lines in (args.lines, SHORT):
                for tag, kernel in kernels.items():
                    seconds = float(kernel.run(f"print(timed({lines}))").split()[-1])
                    times.setdefault((lines, tag), []).append(seconds)
    finally:
        for kernel in kernels.values():
            kernel.close()
    rows = []
    for (lines, tag), seconds in times.items():
        rows.append([f"{lines} lines from 2 ranks{tag}", f"{median(seconds) * 1e3:.1f} ms",
                     f"{median(seconds) / lines * 1e6:.1f}", str(args.repeats)])
    body = table(["a %%ranks cell's display, in a kernel (start to finish)", "in all", "µs per line", "repeats"],
                 rows)
    record("Rank tabs (rank_tabs.py)", body + (f"\n\n{args.note}" if args.note else ""))


if __name__ == "__main__":
    main()
