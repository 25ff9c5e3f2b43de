"""100 launches in one Jupyter kernel: the kernel's processes, file descriptors, threads and
resident memory before and after (and, with ddp_spawn, those of the warm template that forks
the ranks). Target: no growth beyond noise.

    python benchmarks/soak.py [--launches 100] [--strategy ddp_fork|ddp_spawn]
"""
from __future__ import annotations

import argparse
import ast
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Kernel, record, table  # noqa: E402

SETUP = '''
import gc, threading, time, psutil, torch, nbtrain
me = psutil.Process()

def step():
    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Linear(16, 4))
    model(torch.randn(8, 16)).sum().backward()
    ctx.log("x", 1.0, sync_dist=True)
    return ctx.rank

def snapshot():
    gc.collect()
    import nbtrain.placements.template_process
    found = dict(children=len(me.children(recursive=True)), fds=me.num_fds(), threads=threading.active_count(),
                 rss_mib=round(me.memory_info().rss / 2**20, 1))
    running = nbtrain.placements.template_process.template(start=False)
    if running is not None:  # the template is one of the children; its own state counts too
        t = psutil.Process(running.process.pid)
        found.update(template_children=len(t.children()), template_fds=t.num_fds(),
                     template_rss_mib=round(t.memory_info().rss / 2**20, 1))
    return found
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--launches", type=int, default=100)
    parser.add_argument("--strategy", default="ddp_fork")
    args = parser.parse_args()
    kernel = Kernel()
    try:
        kernel.run(SETUP)
        launch = f"nbtrain.launch(step, devices=2, accelerator='cpu', strategy={args.strategy!r}, progress=False)"
        kernel.run(f"{launch}; {launch}")  # warm: first launches import what the ranks use
        before = ast.literal_eval(kernel.run("print(snapshot())").strip())
        elapsed = float(kernel.run(f"t = time.perf_counter()\nfor _ in range({args.launches}): {launch}\n"
                                   "print(time.perf_counter() - t)").strip())
        after = ast.literal_eval(kernel.run("print(snapshot())").strip())
    finally:
        kernel.close()
    rows = [[key, str(before[key]), str(after[key]), f"{after[key] - before[key]:+g}"] for key in before]
    body = table([f"kernel after {args.launches} x {args.strategy} (2 CPU ranks)", "before", "after", "change"], rows)
    record(f"Soak, {args.strategy} (soak.py)", body + f"\n\n{args.launches} launches in {elapsed:.1f} s "
           f"({elapsed / args.launches * 1000:.0f} ms each, launch + one DDP step + a synced log).")


if __name__ == "__main__":
    main()
