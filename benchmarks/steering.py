"""What steering costs and how fast it holds: the step boundary's check, and pause() to every rank held.

  boundary  an empty `ctx.progress` loop (the per-iteration cost of the loop itself, nothing in the
            body), as it is (the step counted, the steering flag read) and as it was before steering
            (the same generator without those lines, kept here), interleaved, the calling thread's
            CPU time, the median of repeats; and the flag's check alone (`if steering.pending:`)
  pause     `launch(..., wait=False)` on 2 CPU ranks (fork, DDP, a tiny model whose step sleeps
            `--step` ms), then pause() / resume() again and again: wall time from pause() being
            called to it returning with every rank held at the agreed step, against the step time

    python benchmarks/steering.py [--repeats 7] [--pauses 20] [--no-save]
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import nbtrain  # noqa: E402
from _common import median, record  # noqa: E402
from nbtrain.common import protocol  # noqa: E402
from nbtrain.rank.context import Context  # noqa: E402
from nbtrain.rank.tally import progressed  # noqa: E402

CLOCK = time.thread_time
ITEMS = 200_000


class Before(Context):
    """`Context._progress` as it was before steering (commit 6566c20), for the side-by-side."""

    def _progress(self, iterable, desc, total, initial):
        level = self._depth
        desc = desc or ("epoch" if level == 0 else "batch")
        self._depth += 1
        self._deepest = max(self._deepest, level)
        emit, rank = self._sink.emit, self.rank
        n, last = initial, time.monotonic()
        emit(protocol.Progress(rank, level, desc, n, total, False, last, initial))
        try:
            for item in iterable:
                yield item
                n += 1
                progressed()
                if self._recorder is not None and level == self._deepest and not self._explicit_steps:
                    self._recorder.step()
                now = time.monotonic()
                if now - last >= 0.1:
                    emit(protocol.Progress(rank, level, desc, n, total, False, now, initial))
                    last = now
        finally:
            self._depth -= 1
            emit(protocol.Progress(rank, level, desc, n, total, True, time.monotonic(), initial))


def per_iteration(ctx: Context) -> float:
    items = range(ITEMS)
    started = CLOCK()
    for _ in ctx.progress(items):
        pass
    return (CLOCK() - started) / ITEMS


def flag_check() -> float:
    steering = Context()._steering
    started = CLOCK()
    for _ in range(ITEMS):
        if steering.pending:
            pass
    checked = CLOCK() - started
    started = CLOCK()
    for _ in range(ITEMS):
        pass
    return (checked - (CLOCK() - started)) / ITEMS


def train(sleep: float):
    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    ctx.steer(model=model, optimizer=opt)
    for _ in ctx.progress(range(10_000_000)):
        loss = model(torch.randn(8, 16)).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        time.sleep(sleep)


def pauses(step_ms: float, count: int) -> tuple[list[float], float]:
    run = nbtrain.launch(train, step_ms / 1e3, devices=2, accelerator="cpu", start="fork", wait=False,
                         progress=False)
    try:
        time.sleep(2.0)
        held = []
        for _ in range(count):
            started = time.perf_counter()
            run.pause()
            held.append(time.perf_counter() - started)
            run.resume()
            time.sleep(0.2)
        step = run._steer._step_time() or float("nan")
        run.stop()
        run.result(timeout=60)
        return held, step
    finally:
        run.cancel()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--pauses", type=int, default=20)
    parser.add_argument("--step", type=float, nargs="*", default=[2.0, 20.0], help="step sleeps, ms")
    parser.add_argument("--no-save", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    now, before = [], []
    for _ in range(args.repeats):  # interleaved: the machine's load falls on both alike
        before.append(per_iteration(Before()))
        now.append(per_iteration(Context()))
    flag = median([flag_check() for _ in range(args.repeats)])
    b, n = median(before), median(now)
    rows = [
        "| a ctx.progress loop, per iteration | before steering | with steering | cost |", "|---|---|---|---|",
        f"| empty body, {ITEMS:,} iterations | {b * 1e6:.3f} µs | {n * 1e6:.3f} µs | {(n - b) * 1e6:+.3f} µs |",
        f"| the flag's check alone (`if steering.pending:`) | | | {flag * 1e6:+.3f} µs |",
        "",
        "| 2 CPU ranks, fork, DDP, step sleeps | step time (ranks' clocks) | pause() to every rank held, median | "
        "90th percentile | max | pauses | target: step + 50 ms |", "|---|---|---|---|---|---|---|",
    ]
    for step_ms in args.step:
        held, step = pauses(step_ms, args.pauses)
        p90 = sorted(held)[int(0.9 * (len(held) - 1))]
        rows.append(f"| {step_ms:g} ms | {step * 1e3:.1f} ms | {median(held) * 1e3:.1f} ms | {p90 * 1e3:.1f} ms | "
                    f"{max(held) * 1e3:.1f} ms | {len(held)} | {(step + 0.05) * 1e3:.0f} ms |")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout
    rows += ["", f"Commit {commit.strip()}. Loop costs: medians of {args.repeats} interleaved repeats, the calling "
             "thread's CPU time. Pauses: wall time of pause() on the notebook's side, each after the run trained "
             "0.2 s on from the last resume(); the ranks stop at their next boundary and the notebook agrees the "
             "furthest step any rank can reach (a rank waiting in the next step's collective says so at once from "
             "its channel thread), so a pause costs up to one step plus the channel's round trips."]
    body = "\n".join(rows)
    if args.no_save:
        print(body)
    else:
        record("Steering (steering.py)", body)


if __name__ == "__main__":
    main()
