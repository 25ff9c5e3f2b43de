"""Live ranks against ipyparallel, in one real Jupyter kernel, 2 CPU ranks.

- start: `nbtrain.Ranks(devices=2)` (forks of the kernel once it is warm; process group ready)
  vs `ipyparallel.Cluster(n=2).start_and_connect_sync()` (2 engines, no process group);
- round trip: `ranks.eval("1")` vs `view.apply_sync(lambda: 1)` and `view.execute("x = 1")`,
  interleaved, median of many;
- interrupt: a `%%ranks` cell sleeping on both ranks, the kernel interrupted from the client:
  seconds until the cell ends with KeyboardInterrupt (the ranks keep their state).

Each round trip row gives the median and the 90th percentile of single calls (a tight tail: p90
<= 2x p50). `--before DIR` times the round trip of another checkout of nbtrain too (e.g. `git
archive <commit> | tar -x -C DIR`), in a second kernel, interleaved with the rest; `--lightning`
also in a kernel that imported pytorch_lightning (~4,000 modules), and `--lightning-before` so
for the other checkout.

    pip install -e ".[bench]" && python benchmarks/live_ranks.py [--calls 300] [--starts 5] [--before DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Kernel, median, record, table  # noqa: E402

SETUP = '''
%load_ext nbtrain
import time, statistics, nbtrain, torch
import ipyparallel as ipp

def timed(fn, n=1):
    values = []
    for _ in range(n):
        t = time.perf_counter(); fn(); values.append(time.perf_counter() - t)
    return values

def block(fn, n):  # one interleaved block: its median and 90th percentile
    values = sorted(timed(fn, n))
    return f"{statistics.median(values)} {values[int(len(values) * 0.9)]}"

def start_nbtrain():
    global ranks
    t = time.perf_counter(); ranks = nbtrain.Ranks(devices=2, accelerator="cpu", progress=False)
    return time.perf_counter() - t

def start_ipp():
    global cluster, rc, view
    t = time.perf_counter()
    cluster = ipp.Cluster(n=2, log_level=40)
    rc = cluster.start_and_connect_sync()
    rc.wait_for_engines(2, timeout=120)
    view = rc[:]
    view.block = True
    return time.perf_counter() - t
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--starts", type=int, default=5)
    parser.add_argument("--interrupts", type=int, default=5)
    parser.add_argument("--note", default="")
    parser.add_argument("--before", help="another checkout of nbtrain: its round trip too, in a second kernel")
    parser.add_argument("--lightning", action="store_true", help="also in a kernel that imported pytorch_lightning")
    parser.add_argument("--lightning-before", action="store_true", help="and so for --before's checkout")
    args = parser.parse_args()
    kernel = Kernel()
    others = {}  # row suffix: a kernel with live ranks of its own
    wanted = [(" (before)", args.before, False)] if args.before else []
    if args.lightning:
        wanted.append((" (Lightning imported)", None, True))
    if args.before and args.lightning_before:
        wanted.append((" (Lightning imported, before)", args.before, True))
    try:
        for tag, checkout, lightning in wanted:
            # another checkout: its nbtrain first on the path, and no checkout in its working directory
            path = os.path.abspath(checkout) if checkout else None
            other = others[tag] = (Kernel(cwd=path, env={**os.environ, "PYTHONPATH": path}) if path else Kernel())
            other.run(SETUP.replace("import ipyparallel as ipp", "import pytorch_lightning" if lightning else ""))
            other.run("start_nbtrain()")
        kernel.run(SETUP)
        kernel.run("start_nbtrain(); ranks.close()")  # the kernel's first fork imports what ranks need (cold)
        nb_starts, ipp_starts = [], []
        for _ in range(args.starts):
            nb_starts.append(float(kernel.run("print(start_nbtrain()); ranks.close()").split()[-1]))
        for _ in range(max(2, args.starts // 2)):  # ~10 s each here: fewer
            ipp_starts.append(float(kernel.run("print(start_ipp()); cluster.stop_cluster_sync()").split()[-1]))
        kernel.run("start_nbtrain(); start_ipp()")
        trips = {"nbtrain ranks.eval('1')": [], "ipyparallel view.apply_sync(lambda: 1)": [],
                 "ipyparallel view.execute('x = 1')": []}
        calls = {"nbtrain ranks.eval('1')": "ranks.eval('1')",
                 "ipyparallel view.apply_sync(lambda: 1)": "view.apply_sync(lambda: 1)",
                 "ipyparallel view.execute('x = 1')": "view.execute('x = 1')"}
        for tag in others:
            trips[f"nbtrain ranks.eval('1'){tag}"] = []
            calls[f"nbtrain ranks.eval('1'){tag}"] = "ranks.eval('1')"
        tails: dict[str, list[float]] = {name: [] for name in trips}
        for _ in range(5):  # interleaved blocks
            for name, call in calls.items():
                runs_in = next((k for tag, k in others.items() if name.endswith(tag)), kernel)
                out = runs_in.run(f"print(block(lambda: {call}, {args.calls // 5}))")
                middle, tail = map(float, out.split()[-2:])
                trips[name].append(middle)
                tails[name].append(tail)
        for other in others.values():
            other.run("ranks.close()")
        kernel.run("cluster.stop_cluster_sync()")
        interrupts = []
        for _ in range(args.interrupts):
            kernel.client.execute("%%ranks\nimport time\ntime.sleep(60)")
            time.sleep(1.5)
            asked = time.monotonic()
            kernel.manager.interrupt_kernel()
            while kernel.client.get_shell_msg(timeout=60)["msg_type"] != "execute_reply":
                pass
            interrupts.append(time.monotonic() - asked)
        kept = kernel.run("print(ranks.eval('ctx.rank'))").strip()
        kernel.run("ranks.close()")
    finally:
        kernel.close()
        for other in others.values():
            other.close()
    ipp_trip = median(trips["ipyparallel view.apply_sync(lambda: 1)"])
    rows = [["start, nbtrain.Ranks(devices=2) (fork, group ready)", f"{median(nb_starts) * 1000:.0f} ms",
             str(len(nb_starts)), ""],
            ["start, ipyparallel Cluster(n=2) (engines, no group)", f"{median(ipp_starts) * 1000:.0f} ms",
             str(len(ipp_starts)), ""]]
    for name, values in trips.items():
        m, tail = median(values), median(tails[name])
        rows.append([f"round trip, {name}", f"{m * 1000:.2f} ms (p90 {tail * 1000:.2f})",
                     f"{args.calls // 5 * len(values)}", f"{m / ipp_trip:.2f}x apply_sync"])
    rows.append(["interrupt to KeyboardInterrupt (%%ranks sleeping, state kept)", f"{median(interrupts) * 1000:.0f} ms",
                 str(len(interrupts)), f"ranks afterwards: {kept}"])
    body = table(["2 CPU ranks, one kernel", "median", "n", "note"], rows)
    ours = median(trips["nbtrain ranks.eval('1')"])
    targets = (f"Targets: start <= 0.5 s by fork ({median(nb_starts):.2f} s here); eval('1') round trip <= 0.3x "
               f"ipyparallel's apply_sync ({ours / ipp_trip:.2f}x here); "
               f"interrupt ends the cell within 3 s ({median(interrupts):.2f} s here).")
    record("Live ranks (live_ranks.py)", body + "\n\n" + targets + (f"\n\n{args.note}" if args.note else ""))


if __name__ == "__main__":
    main()
