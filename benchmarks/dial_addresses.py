"""How long a rank takes to reach the notebook when an address that drops packets silently is
listed ahead of one that works (a network namespace that never answers, as the test makes it;
needs root and `ip`).

    python benchmarks/dial_addresses.py [--runs 3] [--before /work/main]

Two paths: `dial` alone (what every rank does) and a cluster rank's `check_reachable` then
`dial`. `--before DIR` times the same in another checkout (in a child process), for comparison.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent / "tests")]
from _common import median, record, table  # noqa: E402


def timings(silent: str, runs: int) -> dict[str, list[float]]:
    """Seconds to a connected, authenticated channel, each path `runs` times."""
    from nbtrain.common.channel import Hub
    from nbtrain.common.channel_dial import ADDRESS_VAR, AUTHKEY_VAR, addresses, dial
    from nbtrain.placements.clusters.base import check_reachable

    hub = Hub(queue.Queue())
    hub.start()
    try:
        port = hub.environ[ADDRESS_VAR].rsplit(":", 1)[1]
        key = bytes.fromhex(hub.environ[AUTHKEY_VAR])
        listed = f"{silent}:{port},127.0.0.1:{port}"
        out: dict[str, list[float]] = {"dial": [], "check_reachable + dial": []}
        for _ in range(runs):
            began = time.monotonic()
            dial(addresses(listed), key, 0).close()
            out["dial"].append(time.monotonic() - began)
            environ = {ADDRESS_VAR: listed}
            began = time.monotonic()
            check_reachable(environ, 0)
            dial(addresses(environ[ADDRESS_VAR]), key, 0).close()
            out["check_reachable + dial"].append(time.monotonic() - began)
        return out
    finally:
        hub.close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--before", help="another checkout to time the same in, for comparison")
    parser.add_argument("--child", help=argparse.SUPPRESS)  # the silent address, in a --before child
    args = parser.parse_args()
    if args.child:
        print(json.dumps(timings(args.child, args.runs)))
        return
    from test_happy_eyeballs import silent_address

    with silent_address() as silent:
        columns = {}
        if args.before:
            env = {**os.environ, "PYTHONPATH": args.before}
            done = subprocess.run([sys.executable, __file__, "--runs", str(args.runs), "--child", silent],
                                  env=env, capture_output=True, text=True, check=True, cwd=args.before)
            columns["before (addresses in turn)"] = json.loads(done.stdout.strip().splitlines()[-1])
        columns["now (at once, staggered 0.25 s)"] = timings(silent, args.runs)
    header = ["one silent address ahead of one that works, median s", *columns]
    rows = [[path, *(f"{median(c[path]):.2f}" for c in columns.values())] for path in next(iter(columns.values()))]
    record("Reaching the notebook past a silent address (dial_addresses.py)",
           table(header, rows) + f"\n\n{args.runs} runs each; the notebook's channel on loopback, the silent address a "
           "network namespace whose replies go to a blackhole route. A cluster rank runs `check_reachable` "
           "then `dial`; before, the silent address cost `check_reachable` max(5, 30/n) s and `dial` 5 s.")


if __name__ == "__main__":
    main()
