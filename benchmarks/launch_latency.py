"""Launch + 5 DDP steps of a small model on 2 CPU ranks, from one real Jupyter kernel.

Contenders, interleaved round by round: nbtrain start='fork' / 'template' (forks of the warm
template) / 'spawn' (plain spawn) / 'torchrun' (script; labelled by their earlier names), Lightning
Trainer(strategy="ddp_notebook"), Accelerate notebook_launcher, and bare torchrun on the same
script from a shell. The first launch of each in the kernel is reported separately (cold): fork
is fast only once the kernel holds what the ranks import; the template is started by
`nbtrain.warm_up()` in the set-up cell, so its cold launch is the first one after warm_up().

`--before DIR` runs nbtrain's contenders again from another checkout of nbtrain (e.g. `git
archive <commit> | tar -x -C DIR`), in a second kernel, interleaved with the rest: the same
machine and load for both.

    python benchmarks/launch_latency.py [--rounds 5] [--before DIR]
"""
from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Kernel, median, record, table  # noqa: E402

SETUP = '''
import os, time, torch, torch.nn as nn, torch.nn.functional as F
torch.set_num_threads(1)
import nbtrain

def steps(model, device="cpu"):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        loss = F.mse_loss(model(torch.randn(32, 64)), torch.zeros(32, 8))
        opt.zero_grad(); loss.backward(); opt.step()
    return loss.item()

def nbtrain_fn():
    return steps(nbtrain.context().setup(nn.Linear(64, 8)))

def timed(fn):
    t = time.perf_counter(); fn(); print(f"{time.perf_counter() - t:.4f}")

# A checkout from before start= existed (--before) says each start with its combined name.
EARLIER = {"fork": {"strategy": "ddp_fork"}, "template": {"strategy": "ddp_spawn"},
           "spawn": {"strategy": "ddp_spawn", "launcher_options": {"template": False}}, "torchrun": {"strategy": "ddp"}}

def run_nbtrain(start, n=2):
    import inspect
    how = {"start": start} if "start" in inspect.signature(nbtrain.launch).parameters else EARLIER[start]
    timed(lambda: nbtrain.launch(nbtrain_fn, devices=n, accelerator="cpu", progress=False, **how))

print("template ready in", nbtrain.warm_up())

import pytorch_lightning as pl
from torch.utils.data import DataLoader, TensorDataset
class LitModel(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.layer = nn.Linear(64, 8)
    def training_step(self, batch, _):
        x, y = batch
        return F.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
lit_data = DataLoader(TensorDataset(torch.randn(320, 64), torch.zeros(320, 8)), batch_size=32)

def run_lightning(n=2):
    trainer = pl.Trainer(accelerator="cpu", devices=n, strategy="ddp_notebook", max_steps=5, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    timed(lambda: trainer.fit(LitModel(), lit_data))

from accelerate import Accelerator, notebook_launcher
def accelerate_fn():
    accelerator = Accelerator(cpu=True)
    model = accelerator.prepare(nn.Linear(64, 8))
    opt = accelerator.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(5):
        loss = F.mse_loss(model(torch.randn(32, 64)), torch.zeros(32, 8))
        opt.zero_grad(); accelerator.backward(loss); opt.step()

def run_accelerate(n=2):
    timed(lambda: notebook_launcher(accelerate_fn, num_processes=n))

# The floor: plain forks of this kernel that join a gloo group through a FileStore (as nbtrain's
# ranks do) and take the same 5 DDP steps; no channel, no output pipes, no watcher, no teardown
# beyond os._exit. The kernel holds what DDP imports lazily (as nbtrain's fork launches see to).
import shutil, tempfile, torch._dynamo, torch.nn.parallel.distributed, torch.distributed as dist
def bare_fork(n=2):
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    directory = tempfile.mkdtemp()
    def ranks():
        pids = []
        for rank in range(n):
            pid = os.fork()
            if pid == 0:
                code = 1
                try:
                    dist.init_process_group("gloo", store=dist.FileStore(f"{directory}/store", -1), rank=rank,
                                            world_size=n)
                    steps(nn.parallel.DistributedDataParallel(nn.Linear(64, 8)))
                    dist.barrier()
                    code = 0
                finally:
                    os._exit(code)
            pids.append(pid)
        for pid in pids:
            os.waitpid(pid, 0)
    timed(ranks)
    shutil.rmtree(directory, ignore_errors=True)  # after the clock: the store's folder is not left in /tmp
'''

TORCHRUN_SCRIPT = '''
import os, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
torch.set_num_threads(1)
dist.init_process_group("gloo")
model = nn.parallel.DistributedDataParallel(nn.Linear(64, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(5):
    loss = F.mse_loss(model(torch.randn(32, 64)), torch.zeros(32, 8))
    opt.zero_grad(); loss.backward(); opt.step()
dist.barrier()
os._exit(0)  # torch 2.13 (CPU, 2 cores) often aborts a gloo rank at interpreter exit under load
'''

KERNEL_CONTENDERS = {
    # The labels keep their first names, so tables of earlier runs compare: ddp_fork is start='fork', ...
    "nbtrain ddp_fork": "run_nbtrain('fork')",
    "nbtrain ddp_spawn (template)": "run_nbtrain('template')",
    "nbtrain ddp_spawn (plain spawn)": "run_nbtrain('spawn')",
    "nbtrain ddp (script)": "run_nbtrain('torchrun')",
    "Lightning ddp_notebook": "run_lightning()",
    "Accelerate notebook_launcher": "run_accelerate()",
    "bare fork + gloo (floor)": "bare_fork()",
}


def bare_torchrun(script: Path, tries: int = 2) -> float:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.perf_counter()
    # torchrun leaves a torchelastic_* log directory in TMPDIR: the script's own directory takes it.
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
                          "127.0.0.1", "--master-port", str(port), str(script)], capture_output=True, text=True,
                         env={**os.environ, "TMPDIR": str(script.parent)})
    if run.returncode != 0:
        print(f"bare torchrun failed:\n{run.stderr[:3000]}", file=sys.stderr)
        if tries > 1:  # a port taken between choosing it and binding it: choose again
            return bare_torchrun(script, tries - 1)
        raise RuntimeError("bare torchrun failed twice")
    return time.perf_counter() - started


WHERE = "import nbtrain, os; print(os.path.dirname(os.path.dirname(nbtrain.__file__)))"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--before", help="another checkout of nbtrain: its contenders too, in a second kernel")
    args = parser.parse_args()
    contenders = [(name, call, "now") for name, call in KERNEL_CONTENDERS.items()]
    if args.before:
        contenders += [(f"{name} (before)", call, "before") for name, call in KERNEL_CONTENDERS.items()
                       if name.startswith("nbtrain")]
    times: dict[str, list[float]] = {name: [] for name in [*(c[0] for c in contenders), "bare torchrun (shell)"]}
    cold: dict[str, float] = {}
    kernels = {"now": Kernel()}
    if args.before:  # its nbtrain first on the path, and no checkout in its working directory
        before = os.path.abspath(args.before)
        kernels["before"] = Kernel(cwd=before, env={**os.environ, "PYTHONPATH": before})
    with tempfile.TemporaryDirectory() as tmp:
        script = Path(tmp, "train.py")
        script.write_text(textwrap.dedent(TORCHRUN_SCRIPT))
        try:
            checkouts = {which: kernel.run(WHERE).strip() for which, kernel in kernels.items()}
            print("nbtrain from", checkouts, file=sys.stderr)
            assert len(set(checkouts.values())) == len(checkouts), f"both kernels import one nbtrain: {checkouts}"
            for kernel in kernels.values():
                kernel.run(SETUP)
            for round_ in range(args.rounds + 1):  # round 0 is the cold launch of each
                for name, call, which in contenders:
                    try:
                        seconds = float(kernels[which].run(call).strip().splitlines()[-1])
                    except Exception as exc:  # a contender that cannot run here is reported, not fatal
                        print(f"{name}: {str(exc).splitlines()[-1][:200]}", file=sys.stderr)
                        continue
                    (cold.__setitem__(name, seconds) if round_ == 0 else times[name].append(seconds))
                seconds = bare_torchrun(script)
                (cold.__setitem__("bare torchrun (shell)", seconds) if round_ == 0 else
                 times["bare torchrun (shell)"].append(seconds))
                print(f"round {round_} done", file=sys.stderr)
        finally:
            for kernel in kernels.values():
                kernel.close()
    lightning = median(times["Lightning ddp_notebook"])
    torchrun = median(times["bare torchrun (shell)"])
    rows = []
    for name, values in times.items():
        m = median(values)
        rows.append([name, f"{cold.get(name, float('nan')):.3f}", f"{m:.3f}", str(len(values)),
                     f"{m / lightning:.2f}x", f"{m / torchrun:.2f}x"])
    body = table(["launcher (2 CPU ranks, launch + 5 DDP steps)", "cold s", "warm median s", "runs",
                  "vs Lightning ddp_notebook", "vs bare torchrun"], rows)
    fork = median(times["nbtrain ddp_fork"])
    floor = median(times["bare fork + gloo (floor)"])
    targets = (f"Targets: nbtrain ddp_fork <= 0.75x Lightning ddp_notebook "
               f"({fork / lightning:.2f}x here) and <= 1.25x the bare fork + gloo floor ({fork / floor:.2f}x here); "
               f"nbtrain ddp (script) <= 1.1x bare torchrun "
               f"({median(times['nbtrain ddp (script)']) / torchrun:.2f}x here); warm ddp_spawn (template) <= 1.5x "
               f"warm ddp_fork ({median(times['nbtrain ddp_spawn (template)']) / fork:.2f}x here; plain spawn "
               f"{median(times['nbtrain ddp_spawn (plain spawn)']) / fork:.1f}x), and its first launch after "
               f"warm_up() as fast as a warm one ({cold.get('nbtrain ddp_spawn (template)', float('nan')):.3f} s vs "
               f"{median(times['nbtrain ddp_spawn (template)']):.3f} s).")
    if args.before:
        changes = ", ".join(f"{name[len('nbtrain '):]} {median(times[name]):.3f} s (before "
                            f"{median(times[name + ' (before)']):.3f} s)" for name in KERNEL_CONTENDERS
                            if name.startswith("nbtrain"))
        targets += f"\n\nBefore/after (`--before {checkouts['before']}`, in the same rounds): {changes}."
    record("Launch latency (launch_latency.py)", body + "\n\n" + targets)


if __name__ == "__main__":
    main()
