"""The notebook's own CPU time per 2-rank fork launch (launch + 5 DDP steps, warm), beside its
wall time: what the kernel spends starting, watching and ending the ranks, which the ranks'
cores cannot hide on a 2-core machine. With `--before DIR` the same from another checkout, in
processes that alternate with this one's.

    python benchmarks/launch_notebook_cpu.py [--launches 40] [--pairs 3] [--before DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, record, table  # noqa: E402

ONE_RUN = '''
import json, statistics, sys, time, torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
import nbtrain

def fn():
    model = nbtrain.context().setup(nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        loss = F.mse_loss(model(torch.randn(32, 64)), torch.zeros(32, 8))
        opt.zero_grad(); loss.backward(); opt.step()

def go():
    nbtrain.launch(fn, devices=2, accelerator="cpu", progress=False, start="fork")

for _ in range(5):
    go()
wall, cpu = [], []
for _ in range(int(sys.argv[1])):
    t, c = time.perf_counter(), time.process_time()
    go()
    wall.append(time.perf_counter() - t)
    cpu.append(time.process_time() - c)
print(json.dumps({"where": nbtrain.__file__, "wall": statistics.median(wall), "cpu": statistics.median(cpu)}))
'''


def one_run(launches: int, checkout: str | None) -> dict:
    env = {**os.environ, "PYTHONPATH": checkout} if checkout else dict(os.environ)
    done = subprocess.run([sys.executable, "-c", ONE_RUN, str(launches)], env=env, capture_output=True, text=True,
                          check=True, cwd=checkout or os.getcwd())
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=40)
    parser.add_argument("--pairs", type=int, default=3, help="processes per checkout, alternating")
    parser.add_argument("--before", help="another checkout of nbtrain, measured alternately")
    args = parser.parse_args()
    checkouts = {"now": None}
    if args.before:
        checkouts["before"] = os.path.abspath(args.before)
    runs: dict[str, list[dict]] = {name: [] for name in checkouts}
    for _ in range(args.pairs):
        for name, checkout in checkouts.items():
            runs[name].append(one_run(args.launches, checkout))
    def ms(found: list[dict], key: str) -> str:
        return f"{1000 * median([r[key] for r in found]):.1f}"

    rows = [[name, ms(found, "wall"), ms(found, "cpu"), " / ".join(f"{1000 * r['cpu']:.1f}" for r in found)]
            for name, found in runs.items()]
    body = table(["2 CPU ranks, fork, launch + 5 DDP steps", "wall ms", "notebook CPU ms", "each process's median"],
                 rows)
    note = f"\n\nMedians of {args.launches} launches per process, {args.pairs} processes per checkout, alternating."
    if args.before:
        note += f" Before: `--before {checkouts['before']}`."
    record("The notebook's CPU per fork launch (launch_notebook_cpu.py)", body + note)


if __name__ == "__main__":
    main()
