"""A large tensor returned from rank 0 of a 2-rank launch: how fast it reaches the caller, and
how much the caller's memory grows on the way.

Paths, interleaved round by round, each measurement in a fresh process that stands for the
kernel (so its peak RSS belongs to that one transfer):
  shared memory   nbtrain as it is: the rank writes the storage once to /dev/shm, the
                  caller maps it (tensor_files.py)
  pickled bytes   nbtrain with NBTRAIN_SHARED_MEMORY=0, i.e. the old path: the value
                  pickled, sent through the channel's socket, unpickled
  raw mp queue    torch.multiprocessing: a forked child puts the tensor on a Queue, the
                  parent gets it (torch's own shared-memory reduction): the baseline
  floor: one copy no second process: the payload copied once into fresh memory, which any
                  path that materialises it in another process must at least do

GB/s = payload / (time from rank 0's `return` to `launch()` returning in the caller, which
includes the ranks' exit); "incl. touch" also reads one byte of every page of the result
(a mapped result costs its page faults when first used). Peak growth = the caller's peak RSS
(ru_maxrss, after the touch) minus its RSS just before the launch, divided by the payload.

    python benchmarks/large_return.py [--rounds 3] [--sizes 256 500]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, record, table  # noqa: E402

PATHS = ("shared memory", "pickled bytes", "raw mp queue", "floor: one copy")
MB = 2**20


def make_payload(nbytes: int):
    import torch

    import nbtrain

    if nbtrain.context().rank != 0:
        return None
    tensor = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
    return tensor, time.time()


def _warm_up() -> None:
    import nbtrain

    nbtrain.launch(make_payload, MB, devices=2, accelerator="cpu", strategy="ddp_fork", progress=False)


def _raw_child(queue, done, nbytes) -> None:
    import torch

    tensor = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
    queue.put((tensor, time.time()))
    done.wait()  # the sender must outlive the receiver's copy of its handle


def _raw(nbytes: int):
    import torch.multiprocessing as mp

    context = mp.get_context("fork")
    queue, done = context.Queue(), context.Event()
    child = context.Process(target=_raw_child, args=(queue, done, nbytes))
    child.start()
    value = queue.get()
    ended = time.time()
    done.set()
    child.join()
    return value, ended


def measure(path: str, nbytes: int) -> dict:
    """One transfer, in this (fresh) process."""
    import resource

    import psutil
    import torch

    import nbtrain

    if path == "pickled bytes":
        os.environ["NBTRAIN_SHARED_MEMORY"] = "0"  # the ranks inherit it
    _warm_up()
    before = psutil.Process().memory_info().rss
    if path == "raw mp queue":
        (tensor, returned), ended = _raw(nbytes)
    elif path == "floor: one copy":
        source = torch.empty(nbytes, dtype=torch.uint8).fill_(7)
        before = psutil.Process().memory_info().rss
        returned = time.time()
        tensor = torch.empty(nbytes, dtype=torch.uint8).copy_(source)
        ended = time.time()
    else:
        result = nbtrain.launch(make_payload, nbytes, devices=2, accelerator="cpu", strategy="ddp_fork",
                                progress=False)
        ended = time.time()
        tensor, returned = result.value
    int(tensor[::4096].sum())  # one byte of every page
    touched = time.time()
    assert tensor.numel() == nbytes and int(tensor[-1]) == 7
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"gbps": nbytes / (ended - returned) / 1e9, "gbps_touch": nbytes / (touched - returned) / 1e9,
            "growth": (peak - before) / nbytes}


def run_one(path: str, size_mb: int) -> dict:
    out = subprocess.run([sys.executable, __file__, "--one", path, str(size_mb)], capture_output=True, text=True,
                         timeout=600)
    if out.returncode:
        raise RuntimeError(f"{path} {size_mb} MB failed:\n{out.stderr}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 500])
    parser.add_argument("--one", nargs=2, metavar=("PATH", "MB"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        print(json.dumps(measure(args.one[0], int(args.one[1]) * MB)))
        return
    runs: dict[tuple[str, int], list[dict]] = {}
    for round_ in range(args.rounds):
        for size in args.sizes:
            for path in PATHS:
                runs.setdefault((path, size), []).append(run_one(path, size))
                print(f"round {round_ + 1}: {path} {size} MB: {runs[path, size][-1]}", flush=True)
    rows = []
    for size in args.sizes:
        for path in PATHS:
            got = runs[path, size]
            rows.append([path, str(size), f"{median([r['gbps'] for r in got]):.2f}",
                         f"{median([r['gbps_touch'] for r in got]):.2f}", f"{median([r['growth'] for r in got]):.2f}x",
                         ", ".join(f"{r['gbps']:.2f}" for r in got)])
    import torch

    body = (
        f"A uint8 tensor returned from rank 0 of a 2-rank `ddp_fork` launch (CPU, torch {torch.__version__}); each "
        f"measurement in a fresh process standing for the kernel, {args.rounds} interleaved rounds, median. GB/s: "
        "payload over the time from rank 0's `return` to `launch()` returning (ranks' exit included); incl. touch: "
        "until one byte of every page of the result has been read. Peak growth: the caller's peak RSS after the "
        "touch minus its RSS before the launch, over the payload. `pickled bytes` is nbtrain with "
        "NBTRAIN_SHARED_MEMORY=0, the path every return took before; `raw mp queue` is torch.multiprocessing's own "
        "shared-memory Queue between a forked child and its parent; `floor: one copy` is one copy of the payload "
        "into fresh memory within one process, measured in the same rounds.\n\n"
        + table(["path", "MB", "GB/s", "GB/s incl. touch", "peak growth / payload", "runs (GB/s)"], rows)
        + "\n\nTargets: >= 2 GB/s and peak growth <= 1.3x. The machine was shared with other engineers' test runs "
        "while this ran (load average 3-5 on 2 cores), and on this VM the kernel's cost of a fresh page dominates "
        "a copy (the floor row): every path that materialises the payload once in another process is bound by it."
    )
    record("Large return values (large_return.py)", body)


if __name__ == "__main__":
    main()
