"""The first wide launch in a process against the next ones: 32 CPU ranks started by fork, each
timing its own `init_process_group("gloo")`, beside the bare floor (32 plain forks of a process
that imported torch, each joining a gloo group through a FileStore, as nbtrain's ranks do, and
through a TCPStore, as torch's env:// would).

Each round is a fresh interpreter (a new kernel's state: nothing of nbtrain imported yet) that
runs three launches; `--before DIR` runs the same from another checkout of nbtrain in the same
rounds. The question it answers (issue 37): does the first `init_process_group` of a wide launch
cost seconds that later ones do not, and is it ours?

    python benchmarks/first_wide_launch.py [--ranks 32] [--rounds 2] [--before DIR] [--kernel]
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Kernel, median, record, table  # noqa: E402

NBTRAIN = '''
import inspect, json, statistics, sys, time
import torch, nbtrain
# A checkout from before start= existed (--before) says it with its combined name.
how = {"start": "fork"} if "start" in inspect.signature(nbtrain.launch).parameters else {"strategy": "ddp_fork"}

def timed_init():
    import time, torch.distributed as dist
    start = time.perf_counter()
    dist.init_process_group("gloo")
    took = time.perf_counter() - start
    dist.barrier()  # a rank that returns at once can break a peer's set-up still under way (issue 36)
    return took

out = []
for _ in range(3):
    start = time.perf_counter()
    result = nbtrain.launch(timed_init, devices=int(sys.argv[1]), accelerator="cpu", progress=False, **how)
    out.append([time.perf_counter() - start, statistics.median(result.values), max(result.values)])
print(json.dumps(out))
'''

BARE = '''
import json, os, shutil, socket, statistics, sys, tempfile, time
import torch, torch.distributed as dist
os.environ["GLOO_SOCKET_IFNAME"] = "lo"
torch.set_num_threads(1)
n = int(sys.argv[1])

def group(kind):
    directory, (r, w) = tempfile.mkdtemp(), os.pipe()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
    start, pids = time.perf_counter(), []
    for rank in range(n):
        pid = os.fork()
        if pid == 0:
            os.close(r)
            t = time.perf_counter()
            store = (dist.FileStore(f"{directory}/store", -1) if kind == "file"
                     else dist.TCPStore("127.0.0.1", port, n, rank == 0))
            dist.init_process_group("gloo", store=store, rank=rank, world_size=n)
            os.write(w, f"{time.perf_counter() - t}\\n".encode())
            dist.barrier()
            os._exit(0)
        pids.append(pid)
    os.close(w)
    for pid in pids:
        os.waitpid(pid, 0)
    inits = [float(x) for x in os.fdopen(r).read().split()]
    took = time.perf_counter() - start
    shutil.rmtree(directory, ignore_errors=True)  # the store's folder is not left in /tmp
    return [took, statistics.median(inits), max(inits)]

print(json.dumps([group("file"), group("tcp"), group("file")]))
'''


def in_kernel(code: str, ranks: int, env: dict) -> list[list[float]]:
    """`code` in a new Jupyter kernel (as a notebook's first launches are), sys.argv[1] = ranks."""
    kernel = Kernel(env=env, cwd=env.get("PYTHONPATH") or os.getcwd())
    try:
        return json.loads(kernel.run(f"import sys; sys.argv[1:] = [{str(ranks)!r}]\n{code}").strip().splitlines()[-1])
    finally:
        kernel.close()


def run(code: str, ranks: int, env: dict) -> list[list[float]]:
    done = subprocess.run([sys.executable, "-c", code, str(ranks)], capture_output=True, text=True, env=env,
                          timeout=900)
    if done.returncode != 0:
        raise RuntimeError(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--before", help="another checkout of nbtrain, run in the same rounds")
    parser.add_argument("--kernel", action="store_true", help="nbtrain's launches in a new Jupyter kernel each round")
    args = parser.parse_args()
    env = {**os.environ, "NBTRAIN_MAX_CPU_RANKS": str(max(64, args.ranks)), "NBTRAIN_PROGRESS": "0"}
    contenders = {"nbtrain (now)": (NBTRAIN, env)}
    if args.before:
        contenders["nbtrain (before)"] = (NBTRAIN, {**env, "PYTHONPATH": os.path.abspath(args.before)})
    contenders["bare fork + gloo"] = (BARE, env)
    launches = {"nbtrain": ("first launch", "second", "third"), "bare": ("FileStore (first)", "TCPStore",
                                                                         "FileStore (again)")}
    times: dict[tuple[str, str], list[list[float]]] = {}
    for round_ in range(args.rounds):
        for name, (code, environ) in contenders.items():
            measured = (run if name.startswith("bare") or not args.kernel else in_kernel)(code, args.ranks, environ)
            for label, figures in zip(launches[name.split()[0]], measured):
                times.setdefault((name, label), []).append(figures)
        print(f"round {round_} done", file=sys.stderr)
    rows = [[name, label, *(f"{median([f[i] for f in figures]):.2f}" for i in range(3)), str(len(figures))]
            for (name, label), figures in times.items()]
    body = table([f"{args.ranks} CPU ranks, fork", "launch", "whole launch s", "init_process_group median s",
                  "init_process_group max s", "rounds"], rows)
    where = ", in Jupyter kernels" if args.kernel else ""
    record(f"First wide launch (first_wide_launch.py, {args.ranks} ranks{where})", body + (
        f"\n\nEach round a fresh {'Jupyter kernel' if args.kernel else 'interpreter'} (the bare floor: an "
        "interpreter): its first launch is a new kernel's."
        + (f" Before: `--before {args.before}`." if args.before else "") + " For nbtrain the whole launch "
        "counts fork, channel, the user's init_process_group and teardown; init_process_group is timed inside "
        "each rank."))


if __name__ == "__main__":
    main()
