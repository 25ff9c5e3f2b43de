"""How long `explain_pickling` takes to name the one unpicklable leaf in a large graph, beside
the failed pickle attempt itself (what the user ran into before asking why).

The graph: a dict holding 10,000 small objects (each with a list and a dict), one of which
also holds an open sqlite3 connection. Median of interleaved repeats, one process.

    python benchmarks/explain_pickling.py [--objects 10000] [--repeats 7]
"""
from __future__ import annotations

import argparse
import pickle
import sqlite3
import sys
import time
from pathlib import Path

import dill

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, record, table  # noqa: E402
from nbtrain import explain_pickling  # noqa: E402


class Holder:
    def __init__(self, **attrs):
        self.__dict__.update(attrs)


def graph(objects: int, bad) -> dict:
    items = [Holder(i=i, tags=[i, str(i)], meta={"i": i}) for i in range(objects)]
    items[objects * 7 // 9].tags.append(bad)
    return {"items": items, "lr": 0.1}


def failed_dump(module, data) -> None:
    try:
        module.dumps(data)
    except Exception:
        return
    raise AssertionError("the graph pickled: the benchmark's bad leaf is not bad")


def timed(action) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--objects", type=int, default=10_000)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    conn = sqlite3.connect(":memory:")
    data = graph(args.objects, conn)
    picklers = {"dill": dill, "pickle": pickle}
    runs = {(name, what): [] for name in picklers for what in ("failed dumps", "explain_pickling")}
    for _ in range(args.repeats):
        for name, module in picklers.items():
            runs[name, "failed dumps"].append(timed(lambda module=module: failed_dump(module, data)))
            findings = []
            def explain(findings=findings, name=name):  # bound now, not when called (B023)
                findings.extend(explain_pickling(data, pickler=name, name="data"))
            runs[name, "explain_pickling"].append(timed(explain))
            assert [f.path for f in findings] == [f"data['items'][{args.objects * 7 // 9}].tags[2]"], findings
    conn.close()
    rows = [[name, what, f"{median(times) * 1000:.0f}", ", ".join(f"{t * 1000:.0f}" for t in times)]
            for (name, what), times in runs.items()]
    body = (
        f"A dict of {args.objects:,} small objects, one holding an open sqlite3 connection; "
        f"{args.repeats} interleaved repeats, median.\n\n"
        + table(["pickler", "what", "median ms", "runs (ms)"], rows)
    )
    record("Explaining an unpicklable object (explain_pickling.py)", body)


if __name__ == "__main__":
    main()
