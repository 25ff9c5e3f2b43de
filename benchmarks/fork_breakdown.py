"""Where a 2-rank fork launch's start-up goes, timed inside the ranks, and what the ranks' watchers
cost end to end: the kernel's one watcher, a watcher per rank (as before it), none (the numbers
fork_floor.py's section in RESULTS.md quotes).

Plain Python as the kernel. nbtrain's functions are wrapped with timers here, in the parent: the
forked ranks inherit the wrappers. Prints medians; `PYTHONPATH=DIR` times another checkout.

    python benchmarks/fork_breakdown.py [--launches 25]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
import torch.nn.functional as F
from torch import nn

import nbtrain
from nbtrain.placements import processes
from nbtrain.rank import loop

MARKS = os.path.join(tempfile.mkdtemp(), "marks.jsonl")  # one line per rank per launch


def _timed(owner, name: str, label: str, spans: dict) -> None:
    original = getattr(owner, name)

    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spans[label] = (time.perf_counter() - start) * 1e3

    setattr(owner, name, timed)


def _instrument() -> None:
    spans: dict[str, float] = {}
    _timed(processes, "die_with_parent", "die_with_parent", spans)
    _timed(loop.Link, "from_environ", "the channel (Link)", spans)
    fork_main, run = processes.fork_main, loop.RankLoop._do_run

    def forked(*args):
        spans["t0"] = time.perf_counter()
        return fork_main(*args)

    def reached(self, command):
        spans["fork to the function"] = (time.perf_counter() - spans.pop("t0")) * 1e3
        with open(MARKS, "a") as marks:
            marks.write(json.dumps(spans) + "\n")
        return run(self, command)

    processes.fork_main, loop.RankLoop._do_run = forked, reached


def empty():
    return None


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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=25)
    args = parser.parse_args()
    print("nbtrain from", os.path.dirname(nbtrain.__file__))
    watched = processes.die_with_parent
    _instrument()
    for _ in range(args.launches):
        nbtrain.launch(empty, devices=2, accelerator="cpu", start="fork", progress=False)
    rows = [json.loads(line) for line in open(MARKS)][4:]  # the first launches warm up
    for label in rows[0]:
        print(f"{label}: {statistics.median(row[label] for row in rows):.2f} ms (median, {len(rows)} rank starts)")

    def per_rank(parent_pid, thread_bound=True, **_):  # each rank starts a watcher of its own
        return watched(parent_pid, thread_bound)

    def unwatched(parent_pid, thread_bound=True, **_):
        return watched(parent_pid, thread_bound, watched=False)

    ways = {"the kernel's watcher": watched, "a watcher per rank": per_rank, "no watcher": unwatched}
    times: dict[str, list[float]] = {label: [] for label in ways}
    for round_ in range(args.launches + 2):  # interleaved rounds; the first two warm up
        for label, die_with_parent in ways.items():
            processes.die_with_parent = die_with_parent
            start = time.perf_counter()
            nbtrain.launch(five_steps, devices=2, accelerator="cpu", start="fork", progress=False)
            if round_ >= 2:
                times[label].append(time.perf_counter() - start)
    for label, values in times.items():
        print(f"launch + 5 DDP steps, {label}: {statistics.median(values) * 1e3:.1f} ms (median, {len(values)})")
    os.remove(MARKS)
    os.rmdir(os.path.dirname(MARKS))


if __name__ == "__main__":
    main()
