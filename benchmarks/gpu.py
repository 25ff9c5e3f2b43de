"""GPU figures, on a machine with an NVIDIA GPU (CUDA torch):

- single-GPU training through `nbtrain.launch` vs the same raw loop (target >= 0.99);
- DataParallel (strategy="dp") vs DDP (strategy="ddp_fork") on the one GPU;
- nccl process-group start (init + first all_reduce) inside a rank;
- the NVML inventory and how long reading it takes.

Each measurement runs in a fresh interpreter: a forked launch needs CUDA untouched in its parent.

    python benchmarks/gpu.py [--steps 300] [--repeats 3]
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, record, table  # noqa: E402

HIDDEN, BATCH, LOG_EVERY = 4096, 512, 10


def _model():
    import torch

    return torch.nn.Sequential(torch.nn.Linear(HIDDEN, HIDDEN), torch.nn.ReLU(), torch.nn.Linear(HIDDEN, HIDDEN))


def _loop(model, device, steps: int, log) -> float:
    """Steps per second after a warm-up; `log(loss)` every LOG_EVERY steps (a host sync, as logging is)."""
    import torch

    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(BATCH, HIDDEN, device=device)

    def step(i):
        loss = model(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if i % LOG_EVERY == 0:
            log(loss)

    for i in range(20):
        step(i)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for i in range(steps):
        step(i)
    torch.cuda.synchronize()
    return steps / (time.perf_counter() - started)


def raw(steps: int) -> dict:

    return {"steps_per_s": _loop(_model().cuda(), "cuda", steps, lambda loss: loss.item())}


def through_launch(steps: int, strategy: str) -> dict:
    import nbtrain

    def train():
        ctx = nbtrain.context()
        model = ctx.setup(_model())
        rate = _loop(model, ctx.device, steps, lambda loss: ctx.log("loss", loss))
        return rate, type(model).__name__

    started = time.perf_counter()
    result = nbtrain.launch(train, devices=1, accelerator="gpu", strategy=strategy, progress=False)
    rate, wrapper = result.value
    return {"steps_per_s": rate, "wrapper": wrapper, "launch_s": time.perf_counter() - started}


def nccl_start(_steps: int) -> dict:
    import nbtrain

    def start():
        import torch
        import torch.distributed as dist

        ctx = nbtrain.context()
        torch.cuda.set_device(ctx.device)
        started = time.perf_counter()
        dist.init_process_group("nccl", device_id=ctx.device)
        dist.all_reduce(torch.ones(1, device=ctx.device))
        torch.cuda.synchronize()
        seconds = time.perf_counter() - started
        dist.destroy_process_group()
        return seconds

    return {"seconds": nbtrain.launch(start, devices=1, accelerator="gpu", strategy="ddp_spawn", progress=False).value}


def inventory(_steps: int) -> dict:
    import nbtrain

    nbtrain.gpus()  # NVML initialisation, once per process
    started = time.perf_counter()
    table_ = nbtrain.gpus()
    return {"seconds": time.perf_counter() - started, "table": str(table_), "name": table_[0].name}


MEASURES = {"raw": raw, "inprocess": lambda s: through_launch(s, "auto"), "dp": lambda s: through_launch(s, "dp"),
            "ddp_fork": lambda s: through_launch(s, "ddp_fork"), "nccl": nccl_start, "inventory": inventory}


def fresh(name: str, steps: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", name, "--steps", str(steps)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--one", choices=MEASURES, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(MEASURES[args.one](args.steps)))
        return
    runs: dict[str, list[dict]] = {name: [] for name in ("raw", "inprocess", "dp", "ddp_fork", "nccl")}
    for _ in range(args.repeats):  # interleaved
        for name in runs:
            runs[name].append(fresh(name, args.steps))
    inv = fresh("inventory", args.steps)
    rate = {name: median([r["steps_per_s"] for r in rs]) for name, rs in runs.items() if name != "nccl"}
    rows = [
        ["raw loop (no nbtrain)", f"{rate['raw']:.1f}", "1.000", "-"],
        ["nbtrain.launch, in-process (auto, devices=1)", f"{rate['inprocess']:.1f}",
         f"{rate['inprocess'] / rate['raw']:.3f}",
         f"{median([r['launch_s'] for r in runs['inprocess']]):.2f}"],
        ["nbtrain.launch, dp (DataParallel)", f"{rate['dp']:.1f}", f"{rate['dp'] / rate['raw']:.3f}",
         f"{median([r['launch_s'] for r in runs['dp']]):.2f}"],
        ["nbtrain.launch, ddp_fork (DDP, nccl, 1 rank)", f"{rate['ddp_fork']:.1f}",
         f"{rate['ddp_fork'] / rate['raw']:.3f}",
         f"{median([r['launch_s'] for r in runs['ddp_fork']]):.2f}"],
    ]
    body = (f"GPU: {inv['name']}. MLP {HIDDEN}x{HIDDEN}x2, batch {BATCH}, {args.steps} timed steps, loss read every "
            f"{LOG_EVERY} steps; medians of {args.repeats} interleaved runs, each in a fresh interpreter.\n\n"
            + table(["training", "steps/s", "vs raw", "launch s (incl. CUDA init)"], rows)
            + f"\n\nnccl process group start (init + first all_reduce, one rank): "
              f"{median([r['seconds'] for r in runs['nccl']]) * 1000:.0f} ms (median).\n"
            + f"NVML inventory read (`nbtrain.gpus()`, after NVML init): {inv['seconds'] * 1000:.1f} ms.\n\n"
              f"```\n{inv['table']}\n```")
    record("GPU (gpu.py)", body)


if __name__ == "__main__":
    main()
