"""What trackers and a profile cost a run: steps/s of a training loop and the launch's wall time.

A small MLP on 2 CPU ranks (ddp_fork, gloo), ctx.progress and ctx.log(sync_dist=False) every
step. Variants: none, trackers="tensorboard", trackers="mlflow" (a SQLite store in a temporary
run directory), profile=True (torch.profiler over 5 steps, after two skipped), and
tensorboard + profile. Steps/s is timed inside the ranks over the steps after a warm-up, so it
says what writing the trackers and recording the window cost the loop; wall time is the whole
launch (the trackers' set-up, the profile's trace and summary included). Variants interleaved,
each repeated; medians reported.

    python benchmarks/insight_overhead.py [--repeats 3] [--steps 400] [--no-save]
"""
from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import nbtrain  # noqa: E402
from _common import median, record, table  # noqa: E402

VARIANTS = {"none": {}, "tensorboard": {"trackers": "tensorboard"}, "mlflow": {"trackers": "mlflow"},
            "profile": {"profile": True}, "tensorboard+profile": {"trackers": "tensorboard", "profile": True}}
WARMUP = 20


def train(steps: int) -> float:
    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    started = None
    for i in ctx.progress(range(WARMUP + steps), desc="batch"):
        if i == WARMUP:
            started = time.perf_counter()
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        ctx.log("loss", loss)
    return steps / (time.perf_counter() - started)


def measure(repeats: int, steps: int) -> dict[str, dict[str, list[float]]]:
    found = {v: {"rate": [], "wall": []} for v in VARIANTS}
    with tempfile.TemporaryDirectory(prefix="nbtrain-bench-") as runs:
        for repeat in range(repeats):
            for variant, options in VARIANTS.items():
                started = time.perf_counter()
                result = nbtrain.launch(train, steps, devices=2, accelerator="cpu", strategy="ddp_fork",
                                        progress=False, run_dir=f"{runs}/{variant}-{repeat}", **options)
                found[variant]["wall"].append(time.perf_counter() - started)
                found[variant]["rate"].append(min(result.values))  # lock-step: the slower rank's rate
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args(argv)
    found = measure(args.repeats, args.steps)
    base_rate, base_wall = median(found["none"]["rate"]), median(found["none"]["wall"])
    rows = []
    for variant, runs in found.items():
        rate, wall = median(runs["rate"]), median(runs["wall"])
        rows.append([variant, f"{rate:.0f}", f"{rate / base_rate:.3f}", f"{wall:.2f}", f"{wall - base_wall:+.2f}",
                     ", ".join(f"{r:.0f}" for r in runs["rate"])])
    body = (f"Small MLP (64-256-10, batch 64, SGD), 2 CPU ranks (ddp_fork, gloo), torch {torch.__version__}; "
            f"{args.steps} timed steps after {WARMUP} warm-up steps, ctx.log every step; {args.repeats} interleaved "
            "repeats, median. Steps/s timed in the ranks (the slower rank); wall: the whole launch.\n\n"
            + table(["variant", "median steps/s", "ratio to none", "median wall s", "wall vs none s", "runs (steps/s)"],
                    rows))
    if args.no_save:
        print(body)
    else:
        record("Trackers and profiles (insight_overhead.py)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
