"""Launch to first training step of one small DDP script on 2 CPU ranks: nbtrain's ddp script
mode against bare `python -m torch.distributed.run` from a shell.

Contenders, interleaved round by round (the first round is a warm-up and not counted):
  nbtrain launch(fn, start="torchrun") the script's body as a function
  nbtrain cell (run_cell)              the script itself as a %%nbtrain cell (what the magic calls)
  bare torchrun, static rendezvous     the same flags nbtrain passes
  bare torchrun --standalone           what a user types

"first step" is the wall time from the call (or Popen) to rank 0 finishing its first
optimizer step, read from a timestamp rank 0 writes; "total" is until the call returns.

    python benchmarks/script_latency.py [--rounds 5]
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
from _common import median, record, table  # noqa: E402

SCRIPT = '''\
import os, time, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(5):
    loss = F.mse_loss(model(torch.randn(32, 64)), torch.zeros(32, 8))
    opt.zero_grad(); loss.backward(); opt.step()
    if step == 0 and dist.get_rank() == 0:
        with open(os.environ["BENCH_FIRST_STEP"], "w") as f:
            f.write(repr(time.time()))
dist.barrier()
dist.destroy_process_group()
'''


def script_as_function():
    exec(compile(SCRIPT, "<script>", "exec"), {"__name__": "__main__"})


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def timed(start_run, stamp: Path) -> tuple[float, float]:
    """(seconds to rank 0's first step, seconds until done) of one run."""
    stamp.unlink(missing_ok=True)
    started = time.time()
    start_run()
    done = time.time()
    return float(stamp.read_text()) - started, done - started


def contenders(script: Path):
    import nbtrain
    from nbtrain.notebook.ipython.cell import run_cell

    def bare(*flags):
        def run():
            # Exit status aside: torch 2.13 sometimes aborts a finished gloo rank at interpreter exit.
            # torchrun's torchelastic_* log directory goes into the script's own temporary directory.
            subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", *flags,
                            str(script)], capture_output=True, check=False,
                            env={**os.environ, "TMPDIR": str(script.parent)})
        return run

    return {
        "nbtrain launch(fn, strategy='ddp')": lambda: nbtrain.launch(
            script_as_function, start="torchrun", devices=2, accelerator="cpu", progress=False),
        "nbtrain cell (run_cell, as %%nbtrain)": lambda: run_cell(
            SCRIPT, {}, start="torchrun", devices=2, accelerator="cpu", progress=False),
        "bare torchrun, static (nbtrain's flags)": lambda: bare(
            "--nnodes", "1", "--node-rank", "0", "--rdzv-backend", "static", "--master-addr", "127.0.0.1",
            "--master-port", str(free_port()), "--monitor-interval", "0.1")(),
        "bare torchrun --standalone": lambda: bare("--standalone")(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        script, stamp = Path(tmp, "train.py"), Path(tmp, "first_step")
        script.write_text(SCRIPT)
        os.environ["BENCH_FIRST_STEP"] = str(stamp)  # both torchrun and nbtrain pass the environment on
        runs = contenders(script)
        first: dict[str, list[float]] = {name: [] for name in runs}
        total: dict[str, list[float]] = {name: [] for name in runs}
        for round_ in range(args.rounds + 1):
            for name, run in runs.items():
                to_first, to_end = timed(run, stamp)
                if round_:  # round 0 warms the page cache and the benchmark's own imports
                    first[name].append(to_first)
                    total[name].append(to_end)
            print(f"round {round_} done", file=sys.stderr)
    baseline = median(first["bare torchrun, static (nbtrain's flags)"])
    standalone = median(first["bare torchrun --standalone"])
    rows = [[name, f"{median(first[name]):.3f}", f"{median(total[name]):.3f}", str(len(first[name])),
             f"{median(first[name]) / baseline:.2f}x", f"{median(first[name]) / standalone:.2f}x"] for name in runs]
    body = table(["2 CPU ranks, DDP Linear(64, 8), 5 steps", "launch to first step, median s", "total, median s",
                  "runs", "vs bare static", "vs bare --standalone"], rows)
    fn_ratio = median(first["nbtrain launch(fn, strategy='ddp')"]) / baseline
    cell_ratio = median(first["nbtrain cell (run_cell, as %%nbtrain)"]) / baseline
    record("Script mode latency (script_latency.py)",
           body + f"\n\nTarget: nbtrain ddp script mode <= 1.1x bare torchrun (same flags) to the first step: "
                  f"launch(fn) {fn_ratio:.2f}x, cell {cell_ratio:.2f}x here. Interleaved rounds, first round "
                  "not counted. Bare totals include torchrun waiting on ranks' interpreter exit (and the "
                  "occasional gloo abort there), which nbtrain's ranks skip once they have reported.")


if __name__ == "__main__":
    main()
