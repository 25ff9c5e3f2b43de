"""How launch time grows with the world: launch + 5 DDP steps on 2, 4, 8, 16 and 32 CPU ranks,
from one real Jupyter kernel, for nbtrain's fork, template and script placements beside
Lightning's ddp_notebook and Accelerate's notebook_launcher (the same contenders and training
step as launch_latency.py). Every count is oversubscribed on this machine's cores on purpose:
what is measured is the cost of starting and connecting the ranks, not of training.

    python benchmarks/scaling.py [--rounds 3] [--counts 2,4,8,16,32]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Kernel, median, record, table  # noqa: E402
from launch_latency import SETUP  # noqa: E402

CONTENDERS = {
    "nbtrain ddp_fork": "run_nbtrain('fork', {n})",  # the labels keep their first names (see launch_latency.py)
    "nbtrain ddp_spawn (template)": "run_nbtrain('template', {n})",
    "nbtrain ddp (script)": "run_nbtrain('torchrun', {n})",
    "Lightning ddp_notebook": "run_lightning({n})",
    "Accelerate notebook_launcher": "run_accelerate({n})",
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--counts", default="2,4,8,16,32")
    args = parser.parse_args()
    counts = [int(c) for c in args.counts.split(",")]
    times = {(name, n): [] for name in CONTENDERS for n in counts}
    kernel = Kernel()
    try:
        kernel.run(SETUP + f"\nos.environ['NBTRAIN_MAX_CPU_RANKS'] = '{max(counts)}'\n")
        for n in counts:
            for round_ in range(args.rounds + 1):  # round 0 warms each contender up at this count
                for name, call in CONTENDERS.items():
                    try:
                        seconds = float(kernel.run(call.format(n=n)).strip().splitlines()[-1])
                    except Exception as exc:  # a contender that cannot run here is reported, not fatal
                        print(f"{name} x{n}: {str(exc).splitlines()[-1][:200]}", file=sys.stderr)
                        continue
                    if round_:
                        times[name, n].append(seconds)
            print(f"{n} ranks done", file=sys.stderr)
    finally:
        kernel.close()

    def cell(name, n):
        values = times[name, n]
        return f"{median(values):.2f}" if values else "failed"

    rows = [[name, *(cell(name, n) for n in counts)] for name in CONTENDERS]
    body = table(["launch + 5 DDP steps, warm median s", *(f"{n} ranks" for n in counts)], rows)
    record("Launch time against the number of ranks (scaling.py)",
           body + f"\n\nMedians of {args.rounds} warm launches per cell, contenders interleaved in one kernel.")


if __name__ == "__main__":
    main()
