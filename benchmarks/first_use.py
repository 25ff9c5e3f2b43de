"""The first start in a fresh Jupyter kernel against the next one (issue 55): live ranks, a 2-rank
and a 16-rank launch of a function that only joins the group, a 2-rank launch that trains (DDP
and an optimizer, which import torch._dynamo in a rank), and live ranks whose first cell trains.

Each round, for each case and each checkout (this one; `--before DIR`, e.g. a `git archive` of an
older commit), a fresh kernel imports torch and nbtrain (not timed), then runs the case twice,
each timed in the kernel; the cases and checkouts take turns. Bytecode is compiled first in both
checkouts, as an installed package has it.

    python benchmarks/first_use.py [--rounds 3] [--before DIR]
"""
from __future__ import annotations

import argparse
import compileall
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Kernel, median, record, table  # noqa: E402

SETUP = '''
import sys, time, torch, nbtrain

def joins():
    import torch.distributed as dist
    dist.barrier()

def trains():
    import torch
    model = nbtrain.context().setup(torch.nn.Linear(4, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()

TRAIN_CELL = """
model = ctx.setup(torch.nn.Linear(4, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
model(torch.ones(2, 4)).sum().backward()
opt.step()
"""

def timed(case):
    start = time.perf_counter()
    if case.startswith("launch"):
        fn, n = (trains, 2) if "trains" in case else (joins, int(case.split()[1]))
        nbtrain.launch(fn, devices=n, accelerator="cpu", start="fork", progress=False)
    else:
        ranks = nbtrain.Ranks(devices=2, accelerator="cpu", start="fork", progress=False)
        if "trains" in case:
            ranks.exec("import torch\\n" + TRAIN_CELL)
        ranks.close()
    return time.perf_counter() - start
'''

CASES = {
    "Ranks(devices=2) start": "ranks",
    "launch, 2 ranks join the group": "launch 2",
    "launch, 16 ranks join the group": "launch 16",
    "launch, 2 ranks train (DDP, SGD)": "launch trains",
    "Ranks(devices=2), then a cell that trains": "ranks trains",
}


def fresh_kernel(path: str) -> Kernel:
    """A kernel importing nbtrain from `path`; tried once more if it did not answer (a loaded machine)."""
    env = {**os.environ, "PYTHONPATH": path, "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        return Kernel(cwd=path, env=env, startup_timeout=180)
    except RuntimeError:
        return Kernel(cwd=path, env=env, startup_timeout=180)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--before", help="another checkout of nbtrain, timed in kernels of its own, interleaved")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    here = str(Path(__file__).resolve().parents[1])
    checkouts = {"now": here, **({"before": os.path.abspath(args.before)} if args.before else {})}
    for path in checkouts.values():
        compileall.compile_dir(os.path.join(path, "nbtrain"), quiet=1)
    times: dict[tuple[str, str], list[tuple[float, float, bool]]] = {}
    for _ in range(args.rounds):
        for name, case in CASES.items():
            for which, path in checkouts.items():
                kernel = fresh_kernel(path)
                try:
                    kernel.run(SETUP)
                    first = float(kernel.run(f"print(timed({case!r}))").split()[-1])
                    warm = kernel.run("print('torch._dynamo' in sys.modules)").strip() == "True"
                    second = float(kernel.run(f"print(timed({case!r}))").split()[-1])
                finally:
                    kernel.close()
                times.setdefault((name, which), []).append((first, second, warm))
    rows = []
    for (name, which), runs in times.items():
        first, second = median([r[0] for r in runs]), median([r[1] for r in runs])
        warmed = sum(r[2] for r in runs)
        rows.append([name, which, f"{first:.2f}", f"{second:.2f}", f"{first / second:.2f}x",
                     f"{warmed} of {len(runs)}", str(len(runs))])
    body = table(["fresh kernel, CPU, fork", "nbtrain", "first s", "second s", "first / second",
                  "kernel imported torch._dynamo", "rounds"], rows)
    record("First use in a fresh kernel (first_use.py)", body + (f"\n\n{args.note}" if args.note else ""))


if __name__ == "__main__":
    main()
