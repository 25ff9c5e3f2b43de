"""Steady-state training steps/s: a bare torch DDP loop against the same loop in nbtrain.launch.

A small MLP on 2 CPU ranks (gloo). Variants:
  raw      our own fork launcher (multiprocessing 'fork', init_process_group, DDP): the floor
  quiet    nbtrain.launch(strategy="ddp_fork") with ctx.progress (epoch, batch) and
           ctx.log(sync_dist=False) every step, nothing drawn (progress=False): the channel's cost
  line     the same, drawn by the LineDisplay
  widgets  the same, drawn by the WidgetDisplay dashboard: bars, each rank's step rate and memory
           (sampled once a second), the SVG chart of the metrics, then the summary table and PNG
Only the timed steps count (after warm-up, between barriers), so launch cost is excluded: this
measures what reporting and drawing cost a running loop. Variants are interleaved, each
repeated; the median is reported. `--where kernel` runs everything from a real Jupyter
kernel (widget updates then travel as real comm messages); `--where process` (the default:
both) from this process, the dashboard headless.

    python benchmarks/step_overhead.py [--repeats 5] [--steps 600] [--where process kernel] [--note TEXT]

Prints a table and replaces its section of benchmarks/RESULTS.md (--no-save: print only).
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import socket
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _common import Kernel, median, record, table  # noqa: E402

VARIANTS = ("raw", "quiet", "line", "widgets")
WORLD = 2
EPOCHS = 3
WARMUP = 50


def _mlp() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                               torch.nn.ReLU(), torch.nn.Linear(256, 10))


def _timed_loop(model, steps: int, progress=None, log=None) -> float:
    """Steps per second of `steps` SGD steps after a warm-up; identical in every variant."""
    torch.manual_seed(dist.get_rank())
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    wrap = progress or (lambda it, desc: it)

    def step():
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        return loss

    for _ in range(WARMUP):
        step()
    dist.barrier()
    started = time.perf_counter()
    for _ in wrap(range(EPOCHS), desc="epoch"):
        for _ in wrap(range(steps // EPOCHS), desc="batch"):
            loss = step()
            if log is not None:
                log("loss", loss)
    dist.barrier()
    return (steps // EPOCHS * EPOCHS) / (time.perf_counter() - started)


# -- raw: our own launcher -----------------------------------------------------------------

def _raw_rank(rank: int, port: int, steps: int, conn) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD))
    if "OMP_NUM_THREADS" not in os.environ:  # the same rule as nbtrain's ranks
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // WORLD))
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    rate = _timed_loop(torch.nn.parallel.DistributedDataParallel(_mlp()), steps)
    if rank == 0:
        conn.send(rate)
    dist.destroy_process_group()


def run_raw(steps: int) -> float:
    import multiprocessing

    mp = multiprocessing.get_context("fork")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    receive, send = mp.Pipe(duplex=False)
    ranks = [mp.Process(target=_raw_rank, args=(r, port, steps, send)) for r in range(WORLD)]
    for p in ranks:
        p.start()
    rate = receive.recv()
    for p in ranks:
        p.join()
    return rate


# -- nbtrain -------------------------------------------------------------------------------

def _nbtrain_rank(steps: int) -> float:
    import nbtrain

    ctx = nbtrain.context()
    model = ctx.setup(_mlp())
    return _timed_loop(model, steps, progress=ctx.progress, log=lambda name, v: ctx.log(name, v, sync_dist=False))


def run_nbtrain(steps: int, display) -> float:
    import nbtrain

    with contextlib.redirect_stdout(io.StringIO()):  # the displays' lines, not the table's
        result = nbtrain.launch(_nbtrain_rank, steps, devices=WORLD, accelerator="cpu", strategy="ddp_fork",
                                progress=display)
    return result.value


def _display(variant: str):
    from nbtrain.display.text import LineDisplay
    from nbtrain.display.widgets import WidgetDisplay

    if variant == "quiet":
        return False
    return LineDisplay() if variant == "line" else WidgetDisplay()


def measure(repeats: int, steps: int) -> dict[str, dict[str, list[float]]]:
    """Per variant, interleaved (raw, quiet, line, widgets, raw, ...): steps/s of each run and the
    launching process's CPU use during it (% of one core: supervisor, channel and display)."""
    from nbtrain.placements.warm import warm_kernel

    warm_kernel()  # the fork launchers then start equally warm
    for variant in VARIANTS[1:]:  # first-use imports (ipywidgets, gloo) happen here, untimed
        run_nbtrain(EPOCHS * 10, _display(variant))
    runs: dict[str, dict[str, list[float]]] = {v: {"rate": [], "cpu": []} for v in VARIANTS}
    for _ in range(repeats):
        for variant in VARIANTS:
            cpu, wall = time.process_time(), time.perf_counter()
            rate = run_raw(steps) if variant == "raw" else run_nbtrain(steps, _display(variant))
            runs[variant]["rate"].append(rate)
            runs[variant]["cpu"].append(100 * (time.process_time() - cpu) / (time.perf_counter() - wall))
    return runs


def measure_in_kernel(repeats: int, steps: int) -> dict[str, dict[str, list[float]]]:
    kernel = Kernel()
    try:
        out = kernel.run(f"import sys, json; sys.path.insert(0, {str(HERE)!r}); import step_overhead\n"
                         f"print('RATES', json.dumps(step_overhead.measure({repeats}, {steps})))", timeout=1800)
        line = next(line for line in out.splitlines() if line.startswith("RATES "))
        return json.loads(line[len("RATES "):])
    finally:
        kernel.close()


# -- report --------------------------------------------------------------------------------

def _cpus() -> str:
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    threads = os.environ.get("OMP_NUM_THREADS")
    pinned = f"{usable} of {os.cpu_count()} cores usable (affinity)" if usable != os.cpu_count() else f"{usable} cores"
    return pinned + (f", OMP_NUM_THREADS={threads}" if threads else "")


def report(results: dict[str, dict[str, dict[str, list[float]]]], repeats: int, steps: int, note: str = "") -> str:
    rows = []
    for where, runs in results.items():
        raw = runs["raw"]["rate"]
        for variant in VARIANTS:
            rates = runs[variant]["rate"]
            paired = median([r / r0 for r, r0 in zip(rates, raw)])  # same round, same machine weather
            rows.append([where, variant, f"{median(rates):.0f}", f"{median(rates) / median(raw):.3f}", f"{paired:.3f}",
                         f"{median(runs[variant]['cpu']):.1f}", ", ".join(f"{r:.0f}" for r in rates)])
    body = table(["launched from", "variant", "median steps/s", "ratio to raw", "median paired ratio",
                  "launcher CPU %", "runs (steps/s)"], rows)
    return (f"Small MLP (64-256-256-10, batch 64, SGD), {WORLD} CPU ranks, gloo, {_cpus()}, torch {torch.__version__}; "
            f"{steps // EPOCHS * EPOCHS} timed steps after {WARMUP} warm-up steps; {repeats} interleaved repeats, "
            "median. quiet/line/widgets: ctx.progress (epoch, batch) + ctx.log(sync_dist=False) every step, drawn by "
            "no display, the LineDisplay, the WidgetDisplay with its chart and per-rank vitals (headless when launched "
            "from this process, real comm messages from a kernel). "
            "Paired ratio: each run against the raw run of its own round. Launcher CPU: the launching process's "
            "CPU time over the whole launch, % of one core (supervisor, channel, display; the kernel's I/O "
            "threads).\n\n"
            f"{body}\n\nTarget: ratio >= 0.98 for every nbtrain variant." + (f" {note}" if note else ""))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--steps", type=int, default=600, help="timed steps per run")
    parser.add_argument("--where", nargs="+", choices=("process", "kernel"), default=["process", "kernel"])
    parser.add_argument("--no-save", action="store_true", help="print only; leave RESULTS.md alone")
    parser.add_argument("--note", default="", help="a sentence under the table (e.g. that the machine was shared)")
    args = parser.parse_args(argv)
    results = {}
    for where in args.where:
        run = measure if where == "process" else measure_in_kernel
        results[where] = run(args.repeats, args.steps)
    body = report(results, args.repeats, args.steps, args.note)
    if args.no_save:
        print(body)
    else:
        record("Step overhead (step_overhead.py)", body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
