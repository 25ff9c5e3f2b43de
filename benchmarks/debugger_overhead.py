"""What the ranks' debugger costs a launch: nothing while no breakpoint is set.

2 CPU ranks (fork, gloo), a small DDP MLP, `--steps` steps timed inside the ranks (CPU time per
step), and the launch's wall time. Variants, interleaved round by round:
  unhooked    the rank's debugger hook replaced by a no-op (as before the debugger existed)
  none        no breakpoint set: the shipped default (one check per command)
  armed       a breakpoint set in another file: bdb's tracer runs (every Python call pays it)
The ranks are forks of this process, which holds the breakpoints as the kernel does.

    python benchmarks/debugger_overhead.py [--repeats 5] [--steps 300] [--no-save]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import timeit
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, record, table  # noqa: E402

VARIANTS = ("unhooked", "none", "armed")
ELSEWHERE = "/nonexistent/nbtrain-benchmark-cell.py"


def train(steps: int) -> float:
    import torch
    import torch.nn.functional as F

    import nbtrain

    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    started = time.process_time()  # CPU time: the machine's other load shifts it less than wall time
    for _ in range(steps):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return (time.process_time() - started) / steps * 1e3


def one(variant: str, steps: int) -> tuple[float, float]:
    import nbtrain
    from nbtrain.rank.debugger import DEBUGGER

    arm = DEBUGGER.arm
    DEBUGGER.clear_all_breaks()
    if variant == "unhooked":
        DEBUGGER.arm = lambda: None  # type: ignore[method-assign]
    elif variant == "armed":
        DEBUGGER.set_breakpoints(ELSEWHERE, [{"line": 1}], "pass\n")
    try:
        started = time.perf_counter()
        result = nbtrain.launch(train, steps, devices=2, accelerator="cpu", start="fork", progress=False)
        wall = time.perf_counter() - started
    finally:
        DEBUGGER.arm = arm  # type: ignore[method-assign]
        DEBUGGER.clear_all_breaks()
    return wall, median(result.values)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    from nbtrain.rank.debugger import DEBUGGER

    DEBUGGER.clear_all_breaks()
    check = min(timeit.repeat(lambda: (DEBUGGER.arm(), DEBUGGER.disarm()), number=100_000, repeat=5)) / 100_000
    walls: dict[str, list[float]] = {v: [] for v in VARIANTS}
    rates: dict[str, list[float]] = {v: [] for v in VARIANTS}
    one("none", 10)  # warm: imports, DDP's lazy modules
    for _ in range(args.repeats):
        for variant in VARIANTS:
            wall, rate = one(variant, args.steps)
            walls[variant].append(wall)
            rates[variant].append(rate)
    base_wall, base_rate = median(walls["unhooked"]), median(rates["unhooked"])
    rows = [[v, f"{median(walls[v]):.3f}", f"{median(walls[v]) / base_wall:.2f}x", f"{median(rates[v]):.2f}",
             f"{median(rates[v]) / base_rate:.2f}x", str(args.repeats)] for v in VARIANTS]
    body = table(["2 CPU ranks (fork), DDP MLP", "launch wall, median s", "vs unhooked", "CPU ms per step in a rank",
                  "vs unhooked", "runs"], rows)
    body += (f"\n\n`DEBUGGER.arm(); DEBUGGER.disarm()` with no breakpoint set (what each command pays): "
             f"{check * 1e9:.0f} ns. Variants interleaved round by round, {args.steps} steps each, one warm-up launch "
             "not counted. `armed` is what a set breakpoint costs the code it does not stop: bdb's call "
             "hook on every Python call of the rank's main thread. Load average while it ran: "
             f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other work shared the machine).")
    if args.no_save:
        print(body)
    else:
        record("Debugger overhead (debugger_overhead.py)", body)


if __name__ == "__main__":
    main()
