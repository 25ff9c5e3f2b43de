"""Ranks on one node and on two: launch latency and Ctrl-C to nothing left, on SLURM and Ray, on
the two nodes the tests make on one machine (tests/two_nodes.py: network namespaces on a
bridge; needs root, slurm-wlm, munge and ray).

    python benchmarks/two_nodes.py [--runs 4] [--interrupts 2]

Two ranks either way: `devices=2` on one node, or `devices=1, num_nodes=2`. The notebook here is
this process (as a kernel would be); the interrupt is SIGINT to it, as Ctrl-C in a kernel.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import nbtrain  # noqa: E402
from _common import median, record, table  # noqa: E402
from conftest import slurm_unavailable  # noqa: E402
from two_nodes import Network, TwoNodeRay, TwoNodeSlurm, unavailable, wait_until  # noqa: E402

SHAPES = {"1 node x 2 ranks": {"devices": 2}, "2 nodes x 1 rank": {"devices": 1, "num_nodes": 2}}


def rank_after_barrier():
    ctx = nbtrain.context()
    ctx.barrier()
    return ctx.rank


def waits(flag_dir):
    open(os.path.join(flag_dir, f"rank{nbtrain.context().rank}"), "w").close()
    time.sleep(300)


def launch_seconds(cluster, shape) -> float:
    started = time.perf_counter()
    nbtrain.launch(rank_after_barrier, cluster=cluster, progress=False, **shape)
    return time.perf_counter() - started


def interrupt_seconds(cluster, shape, nothing_left) -> tuple[float, float]:
    """(SIGINT to launch raising KeyboardInterrupt, SIGINT to nothing left of the run)."""
    flags = tempfile.mkdtemp(prefix="nbtrain-bench-")
    sent = []

    def interrupt():
        if wait_until(lambda: len(os.listdir(flags)) == 2, 120):
            time.sleep(1)  # inside the user's function
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)

    thread = threading.Thread(target=interrupt)
    thread.start()
    try:
        nbtrain.launch(waits, flags, cluster=cluster, progress=False, **shape)
    except KeyboardInterrupt:
        back = time.monotonic() - sent[0]
    finally:
        thread.join()
        for name in os.listdir(flags):
            os.remove(os.path.join(flags, name))
        os.rmdir(flags)
    wait_until(nothing_left, 60)
    return back, time.monotonic() - sent[0]


def measure(engine, cluster, nothing_left, runs, interrupts) -> list[list[str]]:
    rows = []
    latency = {name: [] for name in SHAPES}
    for _ in range(runs + 1):  # interleaved; the first round (cold) reported apart
        for name, shape in SHAPES.items():
            latency[name].append(launch_seconds(cluster, shape))
    for name, shape in SHAPES.items():
        stops = [interrupt_seconds(cluster, shape, nothing_left) for _ in range(interrupts)]
        rows.append([engine, name, f"{latency[name][0]:.2f}", f"{median(latency[name][1:]):.2f}",
                     f"{median([s[0] for s in stops]):.2f} (max {max(s[0] for s in stops):.2f})",
                     f"{median([s[1] for s in stops]):.2f} (max {max(s[1] for s in stops):.2f})",
                     f"{runs} / {interrupts}"])
    return rows


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--interrupts", type=int, default=2)
    args = parser.parse_args()
    reason = slurm_unavailable() or unavailable()
    if reason:
        print(f"cannot run: {reason}")
        return 1
    rows = []
    network = Network()
    slurm = TwoNodeSlurm(tempfile.mkdtemp(prefix=f"nbtrain-slurm-{os.getpid()}-"), network)
    try:
        network.create()
        slurm.start()
        os.environ["SLURM_CONF"] = str(slurm.conf)

        def slurm_empty():
            return not slurm.jobs() and all(slurm.idle(n) for n in network.nodes)

        rows += measure("SLURM", nbtrain.Slurm(time=10), slurm_empty, args.runs, args.interrupts)
    finally:
        slurm.stop()
        network.remove()
    network = Network("r")
    ray = TwoNodeRay(tempfile.mkdtemp(prefix=f"nbtrain-ray-{os.getpid()}-"), network)
    try:
        network.create()
        ray.start()

        def ray_empty():
            return not any(ray.actors_on(n) for n in network.nodes)

        rows += measure("Ray", nbtrain.Ray(address=ray.address), ray_empty, args.runs, args.interrupts)
    finally:
        ray.stop()
        network.remove()
    record("Two nodes (two_nodes.py)", table(
        ["engine", "ranks", "first launch s", "launch median s", "Ctrl-C to launch raising s",
         "Ctrl-C to nothing left s", "runs / interrupts"], rows) + "\n\n"
        "Two nodes made on this machine (tests/two_nodes.py: network namespaces on a bridge, one `slurmd` or Ray "
        "worker node in each, 2 CPUs each; the Ray head, with none, beside the notebook). Launch: "
        "`launch(fn, cluster=...)` where `fn` passes a barrier of the process group and returns the rank, from "
        "submission to Result, the shapes interleaved, first round apart; the ranks reach the notebook at its "
        "default addresses. Nothing left: for SLURM the job out of `squeue` and no process on either node but its "
        "`slurmd`; for Ray no rank actor's process on either node. The notebook was this process (not a kernel); "
        "the machine (2 cores) was shared with other engineers' test runs. An exited actor process counts as gone "
        "before its raylet reaps it.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
