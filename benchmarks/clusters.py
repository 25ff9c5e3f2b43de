"""Ranks on a cluster, from a real Jupyter kernel: launch latency, and how soon Ctrl-C gives the
kernel back and leaves nothing running, on SLURM (a one-node cluster started here, as the tests
do) and on a local Ray.

    python benchmarks/clusters.py [--runs 5] [--interrupts 3]

Goal (issue 15): an interrupted run returns within 5 s and leaves nothing in the queue or the
Ray cluster. Needs root with slurm-wlm and munge installed for the SLURM rows, and ray.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil

from _common import Kernel, median, record, table

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from conftest import LocalSlurm, slurm_unavailable  # noqa: E402  (the tests' one-node cluster)

CLUSTERS = {"SLURM": "nbtrain.Slurm()", "Ray": "nbtrain.Ray(num_workers=2)"}


def slurm_jobs() -> list[str]:
    return subprocess.run(["squeue", "--noheader", "--format", "%i"], capture_output=True, text=True).stdout.split()


def ranks_running(engine: str) -> int:
    """How many of the run's rank processes run on this machine now."""
    marker = "submitit.core._submit" if engine == "SLURM" else "RankActor"
    count = 0
    for proc in psutil.process_iter(["cmdline"]):
        if any(marker in part for part in proc.info["cmdline"] or ()):
            count += 1
    return count


def interrupt_once(kernel: Kernel, engine: str) -> tuple[float, float]:
    """(seconds from the interrupt to the cell's reply, ... until nothing of the run is left)."""
    kernel.client.execute(f"nbtrain.launch(lambda: time.sleep(300), devices=2, cluster={CLUSTERS[engine]}, "
                          "progress=False)")
    deadline = time.monotonic() + 180
    while ranks_running(engine) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2)  # inside the user's function
    interrupted = time.monotonic()
    kernel.manager.interrupt_kernel()
    while kernel.client.get_shell_msg(timeout=60)["msg_type"] != "execute_reply":
        pass
    returned = time.monotonic() - interrupted
    while (ranks_running(engine) or (engine == "SLURM" and slurm_jobs())) and time.monotonic() - interrupted < 60:
        time.sleep(0.05)
    return returned, time.monotonic() - interrupted


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--interrupts", type=int, default=3)
    args = parser.parse_args()
    reason = slurm_unavailable()
    if reason:
        print(f"no SLURM rows: {reason}")
    cluster = None if reason else LocalSlurm(tempfile.mkdtemp(prefix=f"nbtrain-slurm-{os.getpid()}-"))
    if cluster is not None:
        cluster.start()
        os.environ["SLURM_CONF"] = str(cluster.conf)
    engines = (["SLURM"] if cluster else []) + ["Ray"]
    kernel = Kernel()
    try:
        kernel.run("import time, nbtrain, ray\nray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)")
        latency = {e: [] for e in engines}
        for _ in range(args.runs + 1):  # interleaved; the first round (cold) is reported apart
            for engine in engines:
                out = kernel.run(f"t = time.perf_counter()\nnbtrain.launch(lambda: nbtrain.context().rank, devices=2, "
                                 f"cluster={CLUSTERS[engine]}, progress=False)\nprint(time.perf_counter() - t)")
                latency[engine].append(float(out.split()[-1]))
        stops = {e: [interrupt_once(kernel, e) for _ in range(args.interrupts)] for e in engines}
    finally:
        kernel.run("ray.shutdown()")
        kernel.close()
        if cluster is not None:
            cluster.stop()
    rows = [[e, f"{latency[e][0]:.2f}", f"{median(latency[e][1:]):.2f}",
             f"{median([s[0] for s in stops[e]]):.2f} (max {max(s[0] for s in stops[e]):.2f})",
             f"{median([s[1] for s in stops[e]]):.2f} (max {max(s[1] for s in stops[e]):.2f})",
             f"{args.runs} / {args.interrupts}"] for e in engines]
    record("Clusters (clusters.py)", table(
        ["engine (2 CPU ranks, this machine)", "first launch s", "launch median s", "Ctrl-C to kernel back s",
         "Ctrl-C to nothing left s", "runs / interrupts"], rows) + "\n\n"
        "Launch: `launch(lambda: ctx.rank, devices=2, cluster=...)` from a kernel, submission (or actor creation) "
        "to Result, interleaved, first round apart. SLURM: a one-node slurm-wlm cluster on this machine "
        "(tests/conftest.py's LocalSlurm), a new job per launch; Ray: `ray.init(num_cpus=2)` in the kernel, new "
        "actors per launch (each a fresh worker process). Nothing left: no rank process on this machine, and for "
        "SLURM the job out of `squeue`. Goal: both under 5 s. The machine was shared with other engineers' test runs.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
