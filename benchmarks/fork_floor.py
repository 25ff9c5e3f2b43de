"""The 2-rank warm fork launch against its floor, in more rounds than launch_latency.py gives it:
nbtrain start='fork', the bare fork + gloo floor and Lightning's ddp_notebook in one kernel,
and with `--before DIR` nbtrain start='fork' from another checkout in a second kernel, all
interleaved round by round (launch_latency.py's set-up cell and contenders, without the slow
ones: spawn, torchrun and script mode take seconds a round on 2 cores).

    python benchmarks/fork_floor.py [--rounds 15] [--before DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Kernel, median, record, table  # noqa: E402
from launch_latency import SETUP, WHERE  # noqa: E402

CONTENDERS = {"nbtrain start='fork'": ("now", "run_nbtrain('fork')"),
              "bare fork + gloo (floor)": ("now", "bare_fork()"),
              "Lightning ddp_notebook": ("now", "run_lightning()")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--before", help="another checkout of nbtrain: its start='fork' too, in a second kernel")
    args = parser.parse_args()
    contenders = dict(CONTENDERS)
    kernels = {"now": Kernel()}
    if args.before:
        before = os.path.abspath(args.before)
        kernels["before"] = Kernel(cwd=before, env={**os.environ, "PYTHONPATH": before})
        contenders["nbtrain start='fork' (before)"] = ("before", "run_nbtrain('fork')")
    times: dict[str, list[float]] = {name: [] for name in contenders}
    try:
        checkouts = {which: kernel.run(WHERE).strip() for which, kernel in kernels.items()}
        assert len(set(checkouts.values())) == len(checkouts), f"both kernels import one nbtrain: {checkouts}"
        for kernel in kernels.values():
            kernel.run(SETUP)
        for round_ in range(args.rounds + 1):  # round 0 warms each up
            for name, (which, call) in contenders.items():
                seconds = float(kernels[which].run(call).strip().splitlines()[-1])
                if round_:
                    times[name].append(seconds)
            print(f"round {round_} done", file=sys.stderr)
    finally:
        for kernel in kernels.values():
            kernel.close()
    floor = median(times["bare fork + gloo (floor)"])
    rows = [[name, f"{median(values):.3f}", f"{min(values):.3f}", f"{median(values) / floor:.2f}x", str(len(values))]
            for name, values in times.items()]
    body = table(["2 CPU ranks, launch + 5 DDP steps, warm", "median s", "min s", "vs the floor", "runs"], rows)
    note = "\n\nThe floor: plain forks of the kernel joining gloo through a FileStore, no channel or teardown."
    if args.before:
        note += f" Before: `--before {checkouts['before']}`, in the same rounds."
    record("The 2-rank fork launch against its floor (fork_floor.py)", body + note)


if __name__ == "__main__":
    main()
