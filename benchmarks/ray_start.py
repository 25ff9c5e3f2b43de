"""What `import ray` and a Ray launch cost with jsonschema's IRI format checker taken from
rfc3987-syntax (which Jupyter installs, and which builds 35 Earley parsers at each import) against
rfc3987 (which jsonschema prefers when it can import it). Ray imports jsonschema in every process
it starts: the driver, its agents, and each of nbtrain's rank actors.

Both arms in one run (the imports' rounds interleaved, then each arm's launches in turn, a Ray of
its own): "rfc3987-syntax" hides rfc3987 from every process of the arm (a sitecustomize on
PYTHONPATH that makes its import fail; Ray's workers inherit it), the other runs as installed.
Each launch's ranks report which checker their process loaded.

    python benchmarks/ray_start.py [--imports 5] [--launches 5]

Needs ray and rfc3987 (the test extra has both).
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import median, record, table  # noqa: E402

HIDE = "import sys\nsys.modules['rfc3987'] = None  # its import fails: jsonschema falls back to rfc3987_syntax\n"

DRIVER = '''
import json, sys, time
import ray, nbtrain

def which():
    return "rfc3987_syntax" in sys.modules, "rfc3987" in sys.modules and sys.modules["rfc3987"] is not None

ray.init(num_cpus=2, include_dashboard=False)
times, seen = [], set()
for _ in range(int(sys.argv[1])):
    began = time.monotonic()
    result = nbtrain.launch(which, devices=2, cluster=nbtrain.Ray(), progress=False)
    times.append(time.monotonic() - began)
    seen.update(result.values)
ray.shutdown()
print(json.dumps({"times": times, "seen": sorted(seen)}))
'''


def cpu_of(command: list[str], env: dict) -> float:
    """CPU seconds (user + system) of one process run to its end."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(command, env=env, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--imports", type=int, default=5)
    parser.add_argument("--launches", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as shim:
        Path(shim, "sitecustomize.py").write_text(HIDE)
        arms = {"rfc3987-syntax (Jupyter's)": {**os.environ, "PYTHONPATH": os.pathsep.join(
                    p for p in (shim, os.environ.get("PYTHONPATH")) if p)},
                "rfc3987": dict(os.environ)}
        imports: dict[str, list[float]] = {arm: [] for arm in arms}
        for _ in range(args.imports):
            for arm, env in arms.items():
                imports[arm].append(cpu_of([sys.executable, "-c", "import ray"], env))
        launches = {}
        for arm, env in arms.items():
            done = subprocess.run([sys.executable, "-c", DRIVER, str(args.launches)], env=env, check=True,
                                  capture_output=True, text=True)
            launches[arm] = json.loads(done.stdout.strip().splitlines()[-1])
    rows = []
    for arm in arms:
        times, seen = launches[arm]["times"], launches[arm]["seen"]
        checker = "rfc3987" if seen == [[False, True]] else "rfc3987-syntax" if seen == [[True, False]] else str(seen)
        rows.append([arm, f"{median(imports[arm]):.2f}", f"{times[0]:.2f}", f"{median(times[1:] or times):.2f}",
                     checker])
    body = table(["jsonschema's IRI checker", "`import ray` CPU s (median)", "first launch s",
                  "launch median s", "the actors loaded"], rows)
    body += (f"\n\n`import ray` in a fresh interpreter, {args.imports} rounds interleaved; a launch is "
             f"`launch(f, devices=2, cluster=nbtrain.Ray())` from a plain-Python driver after `ray.init(num_cpus=2)`, "
             f"{args.launches} in a row, each two new actors (fresh worker processes). The test extra installs rfc3987 "
             "(GPL-3.0, a test tool: nbtrain never imports it); docs/clusters.md tells Ray users.")
    record("Ray start-up and jsonschema's IRI checker (ray_start.py)", body)


if __name__ == "__main__":
    main()
