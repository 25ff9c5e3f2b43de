"""The toy sweep of `sweep_throughput.py` under two versions of nbtrain, interleaved: each round
runs a fresh interpreter on the `before` source tree, then one on `after` (the order alternating
from round to round), and each interpreter measures, in this order, the sweep of 16 CPU-bound
trials on 2 CPU slots, sequential `study.optimize` on the same trials, and what a no-op trial
costs a sweep (sweeps of 2 and of 2 + 2k no-op trials on 2 slots, the difference over k: in wall
time per slot, and in the notebook process's CPU time per trial, which the load moves less; and
for a no-op objective that carries `--carry` MB, as one reading a dataset does). A
round's two interpreters run back to back, so a pair shares the machine's load of the moment.

    git archive COMMIT nbtrain | tar -x -C /tmp/before
    python benchmarks/sweep_versions.py /tmp/before . [--rounds 4] [--note TEXT]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, record, table  # noqa: E402

CHILD = r'''
import functools, json, os, sys, time
sys.path.insert(0, BENCHMARKS)
import optuna, nbtrain
import sweep_throughput as toy
optuna.logging.set_verbosity(optuna.logging.WARNING)

def noop(x):
    nbtrain.context().log("loss", x)
    return x

def carrying(data, x):
    nbtrain.context().log("loss", x)
    return x

def sweep_noop(count, fn=noop):
    started, cpu = time.perf_counter(), time.process_time()
    nbtrain.sweep(fn, {"x": optuna.distributions.FloatDistribution(0, 1)}, trials=count, metric="loss", devices=2,
                  accelerator="cpu", study=optuna.create_study(sampler=optuna.samplers.RandomSampler()),
                  progress=False)
    return time.perf_counter() - started, time.process_time() - cpu

lrs = [round(0.001 * 1.25 ** i, 6) for i in range(TRIALS)]
toy.train(0.01, 10, lambda *_: None)
nbtrain.warm_up()
sweep = toy.run_nbtrain(lrs, STEPS)
sequential = toy.run_optuna(lrs, STEPS, 1)
few, many = sweep_noop(2), sweep_noop(2 + 2 * EXTRA)
import numpy
heavy = functools.partial(carrying, numpy.ones(CARRY << 17))  # CARRY MB of float64s
few_heavy, many_heavy = sweep_noop(2, heavy), sweep_noop(2 + 2 * EXTRA, heavy)
print("RESULT", json.dumps({"sweep": sweep, "sequential": sequential, "per_trial_ms": (many[0] - few[0]) / EXTRA * 1000,
                            "notebook_cpu_ms": (many[1] - few[1]) / (2 * EXTRA) * 1000,
                            "carrying_ms": (many_heavy[0] - few_heavy[0]) / EXTRA * 1000,
                            "where": nbtrain.__file__, "load": os.getloadavg()[0]}))
'''


def measure(tree: str, trials: int, steps: int, extra: int, carry: int) -> dict:
    code = (CHILD.replace("BENCHMARKS", repr(str(Path(__file__).parent.absolute())))
            .replace("TRIALS", str(trials)).replace("STEPS", str(steps)).replace("EXTRA", str(extra))
            .replace("CARRY", str(carry)))
    environ = {**os.environ, "PYTHONPATH": str(Path(tree).absolute())}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, env=environ,
                          cwd=tree)  # its nbtrain first, in this process and in the ranks
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    found = json.loads(done.stdout.split("RESULT ", 1)[1])
    assert found["where"].startswith(str(Path(tree).absolute())), (found["where"], tree)  # the tree asked for
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--trials", type=int, default=16)
    parser.add_argument("--steps", type=int, default=1500)
    parser.add_argument("--extra", type=int, default=32, help="each slot's extra no-op trials, for the cost per trial")
    parser.add_argument("--carry", type=int, default=20, help="MB a no-op objective carries (a dataset it reads)")
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    found: dict[str, list[dict]] = {"before": [], "after": []}
    for number in range(args.rounds):
        order = ("before", "after") if number % 2 == 0 else ("after", "before")
        for which in order:
            found[which].append(measure(getattr(args, which), args.trials, args.steps, args.extra, args.carry))
        print({w: {k: round(v, 2) for k, v in found[w][-1].items() if k != "where"} for w in order}, flush=True)
    rows = []
    for which, runs in found.items():
        ratios = [r["sweep"] / r["sequential"] for r in runs]
        rows.append([f"{which} ({args.before if which == 'before' else args.after})",
                     f"{median([r['sweep'] for r in runs]):.2f}", f"{median([r['sequential'] for r in runs]):.2f}",
                     f"{median(ratios):.2f}x", f"{median([r['per_trial_ms'] for r in runs]):.1f}",
                     f"{median([r['notebook_cpu_ms'] for r in runs]):.2f}",
                     f"{median([r['carrying_ms'] for r in runs]):.1f}",
                     ", ".join(f"{r:.2f}" for r in ratios), ", ".join(f"{r['load']:.1f}" for r in runs)])
    body = table(["nbtrain version", "sweep s (median)", "sequential optuna s (median)",
                  "sweep vs sequential (each run's own, median)", "no-op trial ms (median)",
                  "notebook CPU ms per no-op trial (median)", f"no-op trial carrying {args.carry} MB, ms (median)",
                  "sweep vs sequential by round", "load average by round"], rows)
    text = (f"{args.trials} trials of sweep_throughput.py's toy ({args.steps} SGD steps of a 32-128-1 MLP on one "
            f"thread, loss reported every 10 steps) on 2 CPU slots, against sequential `study.optimize` in the same "
            f"interpreter; a no-op trial's cost from sweeps of 2 and {2 + 2 * args.extra} no-op trials (random "
            f"sampler: Optuna's own cost per trial kept small): wall time per slot's trial, and the CPU time of "
            f"the notebook's process (all its threads) per trial; the same for a no-op objective that carries "
            f"{args.carry} MB (a `functools.partial` bound to an array, as a notebook function reads a dataset). "
            f"{args.rounds} rounds, each a fresh interpreter per version, back to back, the order alternating.")
    record("Sweep, two versions of nbtrain interleaved (sweep_versions.py)",
           body + "\n\n" + text + (f"\n\n{args.note}" if args.note else ""))


if __name__ == "__main__":
    main()
