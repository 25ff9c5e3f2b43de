"""What a submitted run costs over a launch: 2 CPU ranks, 5 DDP steps of a small model, from a
script (no kernel). Interleaved round by round:

- `submit()` returning (the run directory, the job pickled, the supervisor started);
- `submit(...).result()`: to the Result read back from the run directory;
- `launch()` of the same function in this process (ddp_fork), for comparison;
- `attach(run_dir).result()` of a finished run: reading the Result back.

    python benchmarks/submit_latency.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

import nbtrain

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, record, table  # noqa: E402


def five_steps():
    model = nbtrain.context().setup(nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        loss = F.mse_loss(model(torch.randn(32, 64)), torch.zeros(32, 8))
        opt.zero_grad()
        loss.backward()
        opt.step()
    return loss.item()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    rounds = parser.parse_args().rounds
    times: dict[str, list[float]] = {k: [] for k in ("returns", "result", "launch", "attach")}
    base = Path(tempfile.mkdtemp(prefix="nbtrain-bench-submit-"))
    try:
        nbtrain.launch(five_steps, devices=2, accelerator="cpu", progress=False)  # warm: imports, first fork
        for n in range(rounds):
            start = time.perf_counter()
            run = nbtrain.submit(five_steps, devices=2, accelerator="cpu", run_dir=base / str(n))
            times["returns"].append(time.perf_counter() - start)
            run.result(timeout=120)
            times["result"].append(time.perf_counter() - start)
            start = time.perf_counter()
            nbtrain.attach(base / str(n)).result()
            times["attach"].append(time.perf_counter() - start)
            start = time.perf_counter()
            nbtrain.launch(five_steps, devices=2, accelerator="cpu", progress=False)
            times["launch"].append(time.perf_counter() - start)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    launch = median(times["launch"])
    rows = [["submit() returns", f"{median(times['returns']):.3f}", "", str(rounds)],
            ["submit(...).result()", f"{median(times['result']):.3f}", f"{median(times['result']) / launch:.1f}x",
             str(rounds)],
            ["launch() in this process (ddp_fork)", f"{launch:.3f}", "1.0x", str(rounds)],
            ["attach(run_dir).result() of a finished run", f"{median(times['attach']):.3f}", "", str(rounds)]]
    record("Submitted runs (submit_latency.py)",
           table(["2 CPU ranks, 5 DDP steps", "median s", "vs launch", "runs"], rows)
           + "\n\nsubmit(...).result() includes the supervisor's start: a fresh interpreter that imports torch "
             "and nbtrain, then forks the ranks as launch does; the run directory is polled every 0.2 s.")


if __name__ == "__main__":
    main()
