"""start='spawn' on 2 and 8 CPU ranks, from real Jupyter kernels: now (multiprocess's spawn
context) against another checkout of nbtrain (`--before DIR`, e.g. the subprocess launcher of
6566c20: `git archive 6566c20 | tar -x -C DIR`), interleaved, in kernels of their own.

Each rank returns the moment its function began, so a launch splits into "to the function"
(interpreters, imports, the rank's set-up, the rendezvous) and the rest (the result back, the
processes' exits). Cold: the first launch in a fresh kernel (nbtrain's and multiprocess's imports
in the kernel, the kernel's watcher, multiprocess's resource tracker); warm: later launches in
the same kernel. Each round starts fresh kernels: one pair for the 2-rank cold launch and the
warm ones, one pair for the 8-rank cold launch. Within a round, now and before alternate
which goes first.

    python benchmarks/spawn_start.py --before DIR [--rounds 3] [--warm 2]

`--mechanism N`: where the time goes, without torch: N starts of a bare child each way,
interleaved, from this process: the parent's share (multiprocess's `start()`, or Popen and
the pickles written to the child's stdin) and the time until the child has imported dill and
nbtrain's package (which a rank imports next in both ways, to unpack its job).

    python benchmarks/spawn_start.py --mechanism 30
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Kernel, median, record, table  # noqa: E402

SETUP = '''
import os, time, json, inspect, nbtrain
os.environ["NBTRAIN_MAX_CPU_RANKS"] = "8"

def began():
    return time.time()

def spawned(n):
    how = ({"start": "spawn"} if "start" in inspect.signature(nbtrain.launch).parameters
           else {"strategy": "ddp_spawn", "launcher_options": {"template": False}})
    t0 = time.time()
    values = nbtrain.launch(began, devices=n, accelerator="cpu", progress=False, **how).values
    print(json.dumps([max(values) - t0, time.time() - t0]))
'''

WHERE = "import nbtrain, os; print(os.path.dirname(os.path.dirname(nbtrain.__file__)))"


def kernels(before: str) -> dict[str, Kernel]:
    pair = {"now": Kernel(), "before": Kernel(cwd=before, env={**os.environ, "PYTHONPATH": before})}
    where = {which: kernel.run(WHERE).strip() for which, kernel in pair.items()}
    assert where["now"] != where["before"], f"both kernels import one nbtrain: {where}"
    for kernel in pair.values():
        kernel.run(SETUP)
    return pair


def launch(kernel: Kernel, n: int) -> tuple[float, float]:
    import json

    to_fn, total = json.loads(kernel.run(f"spawned({n})").strip().splitlines()[-1])
    return to_fn, total


# The subprocess launcher's program (6566c20), up to what a rank imports next.
BEFORE_CHILD = ("import os, pickle, sys, time; os.setpgid(0, 0); "
                "sys.path[:], sys.argv[:] = pickle.load(sys.stdin.buffer); pickle.load(sys.stdin.buffer); "
                "import dill, nbtrain.rank.spawned; print(time.time(), flush=True)")


def _ready(conn) -> None:
    """The multiprocess child, as `rank/spawned.main` begins, up to where the subprocess one is."""
    import time

    from nbtrain.rank.spawned import leave_kernel_group

    leave_kernel_group()
    import dill  # noqa: F401

    conn.send(time.time())
    conn.close()


def mechanism(count: int) -> None:
    import pickle
    import time

    import multiprocess

    from nbtrain.placements.processes import _main_stays_here, _sigint_held, _spawn_context

    context = _spawn_context()
    times: dict[str, list[tuple[float, float]]] = {"now": [], "before": []}
    for _ in range(count):
        t0 = time.time()
        reader, writer = context.Pipe(duplex=False)
        proc = context.Process(target=_ready, args=(writer,))
        with _main_stays_here(), _sigint_held():
            proc.start()
        parent = time.time() - t0
        writer.close()
        times["now"].append((parent, reader.recv() - t0))
        proc.join()
        reader.close()
        t0 = time.time()
        child = subprocess.Popen([sys.executable, "-c", BEFORE_CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 process_group=0)
        with child.stdin:
            pickle.dump((sys.path, sys.argv), child.stdin)
            pickle.dump((b"job" * 1000, False, dict(os.environ), os.getpid(), None), child.stdin)
        parent = time.time() - t0
        times["before"].append((parent, float(child.stdout.read()) - t0))
        child.wait()
        child.stdout.close()
    rows = [[which, f"{1000 * median([p for p, _ in values]):.1f}", f"{1000 * median([c for _, c in values]):.0f}",
             str(len(values))] for which, values in (("multiprocess spawn (now)", times["now"]),
                                                   ("subprocess (before)", times["before"]))]
    body = table(["a bare spawned child", "parent's share ms", "to dill and nbtrain imported ms", "starts"], rows)
    body += (f"\n\nMedians, interleaved; multiprocess {multiprocess.__version__}; load average "
             f"{os.getloadavg()[0]:.1f}. The parent's share is multiprocess pickling the preparation data and "
             "the Process with dill, once per rank, one rank after another; the child's extra is multiprocess's "
             "own modules (its `import multiprocess` imports dill, which a rank imports in both ways anyway) "
             "and its preparation.")
    record("Plain spawn: where a rank's start goes (spawn_start.py --mechanism)", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mechanism", type=int, help="bare starts each way, no torch, no launch")
    parser.add_argument("--before", help="another checkout of nbtrain (the launcher compared)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--warm", type=int, default=2, help="warm launches of each size per round")
    args = parser.parse_args()
    if args.mechanism:
        return mechanism(args.mechanism)
    if not args.before:
        parser.error("--before DIR (or --mechanism N)")
    before = os.path.abspath(args.before)
    times: dict[tuple[str, str], list[tuple[float, float]]] = {}
    load = []
    for round_ in range(args.rounds):
        order = ["now", "before"] if round_ % 2 == 0 else ["before", "now"]
        load.append(os.getloadavg()[0])
        pair = kernels(before)
        try:
            for which in order:
                times.setdefault((which, "2 ranks, cold"), []).append(launch(pair[which], 2))
            for _ in range(args.warm):
                for n in (2, 8):
                    for which in order:
                        times.setdefault((which, f"{n} ranks, warm"), []).append(launch(pair[which], n))
        finally:
            for kernel in pair.values():
                kernel.close()
        pair = kernels(before)
        try:
            for which in order:
                times.setdefault((which, "8 ranks, cold"), []).append(launch(pair[which], 8))
        finally:
            for kernel in pair.values():
                kernel.close()
        print(f"round {round_} done: {times}", file=sys.stderr)
    load.append(os.getloadavg()[0])
    rows = []
    for case in ("2 ranks, cold", "2 ranks, warm", "8 ranks, cold", "8 ranks, warm"):
        now, old = times[("now", case)], times[("before", case)]
        m_now, m_old = median([t for _, t in now]), median([t for _, t in old])
        rows.append([case, f"{m_now:.2f}", f"{median([f for f, _ in now]):.2f}", f"{m_old:.2f}",
                     f"{median([f for f, _ in old]):.2f}", f"{m_now / m_old:.2f}x", str(len(now))])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).parent).stdout.strip()
    body = table(["start='spawn', CPU ranks", "now s", "now: to the function s", "before s",
                  "before: to the function s", "now / before", "launches each"], rows)
    body += (f"\n\nNow: commit {commit} (multiprocess's spawn context); before: `{before}` (the subprocess "
             f"launcher). Medians, interleaved; load average {min(load):.1f}-{max(load):.1f} on this machine.")
    record("Plain spawn: multiprocess against subprocess (spawn_start.py)", body)


if __name__ == "__main__":
    main()
