"""A training function that calls `dist.destroy_process_group()` itself, as the PyTorch tutorials
do, against one that leaves the group to nbtrain, and Lightning's `ddp_notebook`: 2 CPU ranks
forked from one real Jupyter kernel that holds what a notebook holds (Lightning, Transformers).

Each contender sets up the group, builds a DDP model and takes 5 steps. nbtrain carries out the
user's destroy once the command's objects are freed (a garbage collection first: the teardown-
hang protection); in a fork of the kernel that collection used to walk the kernel's whole heap.

`--before DIR` runs nbtrain's contenders again from another checkout (e.g. `git archive <commit>
| tar -x -C DIR`), in a second kernel, interleaved round by round with the rest.

    python benchmarks/user_destroy.py [--rounds 7] [--before DIR]
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import Kernel, median, record, table  # noqa: E402

SETUP = '''
import time, torch, torch.nn as nn, torch.nn.functional as F, torch.distributed as dist
import pytorch_lightning as pl, transformers  # what a notebook has imported: a kernel heap of its size
import nbtrain
from torch.utils.data import DataLoader, TensorDataset
import inspect
FORK = {"start": "fork"} if "start" in inspect.signature(nbtrain.launch).parameters else {"strategy": "ddp_fork"}

def steps(model):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(5):
        loss = F.mse_loss(model(torch.randn(32, 64)), torch.zeros(32, 8))
        opt.zero_grad(); loss.backward(); opt.step()

def users_own_group(destroy):
    dist.init_process_group("gloo")
    steps(nn.parallel.DistributedDataParallel(nn.Linear(64, 8)))
    if destroy:
        dist.destroy_process_group()

def timed(fn):
    t = time.perf_counter(); fn(); print(f"{time.perf_counter() - t:.4f}")

def run_nbtrain(destroy):
    timed(lambda: nbtrain.launch(users_own_group, destroy, devices=2, accelerator="cpu", progress=False, **FORK))

class LitModel(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.layer = nn.Linear(64, 8)
    def training_step(self, batch, _):
        x, y = batch
        return F.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)
lit_data = DataLoader(TensorDataset(torch.randn(320, 64), torch.zeros(320, 8)), batch_size=32)

def run_lightning():
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy="ddp_notebook", max_steps=5, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    timed(lambda: trainer.fit(LitModel(), lit_data))
'''

CONTENDERS = {
    "nbtrain fork, user calls destroy_process_group()": "run_nbtrain(True)",
    "nbtrain fork, group left to nbtrain": "run_nbtrain(False)",
    "Lightning ddp_notebook": "run_lightning()",
}

WHERE = "import nbtrain, os; print(os.path.dirname(os.path.dirname(nbtrain.__file__)))"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--before", help="another checkout of nbtrain: its contenders too, in a second kernel")
    args = parser.parse_args()
    contenders = [(name, call, "now") for name, call in CONTENDERS.items()]
    kernels = {"now": Kernel()}
    if args.before:
        before = os.path.abspath(args.before)
        kernels["before"] = Kernel(cwd=before, env={**os.environ, "PYTHONPATH": before})
        contenders += [(f"{name} (before)", call, "before") for name, call in CONTENDERS.items()
                       if name.startswith("nbtrain")]
    times: dict[str, list[float]] = {name: [] for name, _, _ in contenders}
    try:
        checkouts = {which: kernel.run(WHERE).strip() for which, kernel in kernels.items()}
        assert len(set(checkouts.values())) == len(checkouts), f"both kernels import one nbtrain: {checkouts}"
        for kernel in kernels.values():
            kernel.run(SETUP)
        for round_ in range(args.rounds + 1):  # round 0 warms each contender and is not counted
            for name, call, which in contenders:
                seconds = float(kernels[which].run(call).strip().splitlines()[-1])
                if round_:
                    times[name].append(seconds)
            print(f"round {round_} done", file=sys.stderr)
    finally:
        for kernel in kernels.values():
            kernel.close()
    lightning = median(times["Lightning ddp_notebook"])
    kept = median(times["nbtrain fork, group left to nbtrain"])
    rows = [[name, f"{median(v):.3f}", str(len(v)), f"{median(v) / lightning:.2f}x", f"{median(v) / kept:.2f}x"]
            for name, v in times.items()]
    body = table(["2 CPU ranks, init + DDP + 5 steps (kernel holding Lightning and Transformers)", "median s", "runs",
                  "vs Lightning ddp_notebook", "vs nbtrain without the destroy"], rows)
    record("A user's destroy_process_group (user_destroy.py)", body + (
        "\n\nThe destroy is carried out after a garbage collection (what keeps a DDP model's teardown from hanging a "
        "rank); a rank now freezes what it inherited (`gc.freeze()` as it starts), so that collection walks only "
        "what the rank made." + (f" Before: `--before {checkouts['before']}`, same rounds." if args.before else "")))


if __name__ == "__main__":
    main()
