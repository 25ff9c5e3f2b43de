"""What a submitted run costs over a launch: 2 CPU ranks, 5 DDP steps of a small model, from a
real Jupyter kernel. Interleaved round by round:

- `submit()` returning (the run directory, the job pickled, the supervisor started);
- `submit(...).result()`: to the Result read back from the run directory;
- `launch()` of the same function in the same kernel (start='fork'), for comparison;
- `attach(run_dir).result()` of a finished run: reading the Result back;
- the supervisor's imports alone (`python -c "import nbtrain.notebook.detached.supervise"`), the cost a
  supervisor started as a fresh interpreter pays before it runs anything.

Round 0 is each kernel's first submit (cold: for this nbtrain, it starts the kernel's warm
template, which later submits fork the supervisor from); the medians are of the later rounds.
`--before DIR` runs the same in a second kernel importing another checkout of nbtrain (e.g.
`git archive <commit> | tar -x -C DIR`), in the same rounds: the same machine and load.

    python benchmarks/submit_latency.py [--rounds 5] [--before DIR]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Kernel, median, record, table  # noqa: E402

SETUP = '''
import time, torch, torch.nn as nn, torch.nn.functional as F
import nbtrain

def five_steps():
    model = nbtrain.context().setup(nn.Linear(64, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        loss = F.mse_loss(model(torch.randn(32, 64)), torch.zeros(32, 8))
        opt.zero_grad(); loss.backward(); opt.step()
    return loss.item()

def timed_submit(run_dir):
    start = time.perf_counter()
    run = nbtrain.submit(five_steps, devices=2, accelerator="cpu", run_dir=run_dir)
    returned = time.perf_counter() - start
    run.result(timeout=300)
    result = time.perf_counter() - start
    start = time.perf_counter()
    nbtrain.attach(run_dir).result()
    print(f"{returned:.4f} {result:.4f} {time.perf_counter() - start:.4f}")

def timed_launch():
    start = time.perf_counter()
    nbtrain.launch(five_steps, devices=2, accelerator="cpu", progress=False)
    print(f"{time.perf_counter() - start:.4f}")

timed_launch()  # warm: the kernel's imports and its first fork
'''

WHERE = "import nbtrain, os; print(os.path.dirname(os.path.dirname(nbtrain.__file__)))"
MEASURES = ("returns", "result", "attach", "launch", "supervisor imports")


def last(output: str) -> str:
    """A cell's last line: the figures (nbtrain may say a line of its own first)."""
    return output.strip().splitlines()[-1]


def supervisor_imports(env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import nbtrain.notebook.detached.supervise"], check=True, env=env)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", help="another checkout of nbtrain: the same, in a second kernel")
    args = parser.parse_args()
    which = ["now", *(["before"] if args.before else [])]
    times = {(w, m): [] for w in which for m in MEASURES}
    cold: dict[tuple[str, str], float] = {}
    envs = {"now": dict(os.environ)}
    kernels = {"now": Kernel()}
    if args.before:  # its nbtrain first on the path, and no checkout in its working directory
        before = os.path.abspath(args.before)
        envs["before"] = {**os.environ, "PYTHONPATH": before}
        kernels["before"] = Kernel(cwd=before, env=envs["before"])
    try:
        checkouts = {w: kernel.run(WHERE).strip() for w, kernel in kernels.items()}
        print("nbtrain from", checkouts, file=sys.stderr)
        assert len(set(checkouts.values())) == len(checkouts), f"both kernels import one nbtrain: {checkouts}"
        for kernel in kernels.values():
            kernel.run(SETUP)
        with tempfile.TemporaryDirectory(prefix="nbtrain-bench-submit-") as base:
            for round_ in range(args.rounds + 1):  # round 0: each kernel's first submit
                for w in which:
                    run_dir = Path(base, f"{w}-{round_}")
                    said = kernels[w].run(f"timed_submit({str(run_dir)!r})")
                    returned, result, attach = map(float, last(said).split())
                    launch = float(last(kernels[w].run("timed_launch()")))
                    imports = supervisor_imports(envs[w])
                    for measure, seconds in zip(MEASURES, (returned, result, attach, launch, imports)):
                        (cold.__setitem__((w, measure), seconds) if round_ == 0 else times[w, measure].append(seconds))
                print(f"round {round_} done", file=sys.stderr)
    finally:
        for kernel in kernels.values():
            kernel.close()
    rows = []
    labels = {"returns": "submit() returns", "result": "submit(...).result()", "attach":
              "attach(run_dir).result() of a finished run", "launch": "launch() in the same kernel (start='fork')",
              "supervisor imports": "a fresh interpreter importing the supervisor's modules"}
    for measure in MEASURES:
        for w in which:
            m = median(times[w, measure])
            versus = m / median(times[w, "launch"])
            rows.append([f"{labels[measure]} ({w})", f"{cold[w, measure]:.3f}", f"{m:.3f}",
                         f"{versus:.1f}x" if measure in ("result", "launch") else "", str(len(times[w, measure]))])
    body = table(["2 CPU ranks, 5 DDP steps", "first (cold) s", "median s", "vs launch", "runs"], rows)
    note = ("\n\nThe supervisor is a fork of the kernel's warm template once that is ready (torch imported); a "
            "kernel's first submit does not wait for it: its supervisor is a fresh interpreter while the template "
            "starts in the background. It runs no torch.distributed.checkpoint import unless a checkpoint is saved, "
            "and Run.result() is woken by the run's end (inotify on the run directory, a pidfd on the supervisor).")
    if args.before:
        note += f" Before: `--before {checkouts['before']}`, in the same rounds."
    record("Submitted runs (submit_latency.py)", body + note)


if __name__ == "__main__":
    main()
