"""Where DDP's cost on one rank goes: a raw loop against DistributedDataParallel at world size 1,
with DDP's defaults, with `gradient_as_bucket_view=True` (gradients are views into the
all-reduce buckets: no copy into the bucket and back), and with `static_graph=True` too.

One process, a one-rank process group (gloo on CPU, nccl on a GPU), interleaved repeats,
median steps/s and its ratio to the raw loop. On a GPU the model is the one benchmarks/gpu.py
uses (2 x Linear(4096, 4096), batch 512); on CPU a smaller one, so a run takes a minute.

    python benchmarks/ddp_one_rank.py [--steps 200] [--repeats 5] [--note "..."]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _common import record, table  # noqa: E402

VARIANTS = {
    "raw loop": None,
    "DDP, defaults": {},
    "DDP, gradient_as_bucket_view": {"gradient_as_bucket_view": True},
    "DDP, gradient_as_bucket_view + static_graph": {"gradient_as_bucket_view": True, "static_graph": True},
}


def main() -> None:
    import torch
    import torch.distributed as dist

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--note", default="")
    args = parser.parse_args()
    gpu = torch.cuda.is_available()
    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    hidden, batch = (4096, 512) if gpu else (1024, 256)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group("nccl" if gpu else "gloo", rank=0, world_size=1)

    def rate(options) -> float:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                                    torch.nn.Linear(hidden, hidden)).to(device)
        if options is not None:
            model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[0] if gpu else None, **options)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        x = torch.randn(batch, hidden, device=device)

        def step():
            loss = model(x).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            return loss

        for _ in range(10):
            step()
        if gpu:
            torch.cuda.synchronize()
        started = time.perf_counter()
        for i in range(args.steps):
            loss = step()
            if i % 10 == 0:
                loss.item()  # a host sync now and then, as logging does
        if gpu:
            torch.cuda.synchronize()
        return args.steps / (time.perf_counter() - started)

    rates: dict[str, list[float]] = {name: [] for name in VARIANTS}
    for _ in range(args.repeats):
        for name, options in VARIANTS.items():
            rates[name].append(rate(options))
    dist.destroy_process_group()
    raw = statistics.median(rates["raw loop"])
    rows = [[name, f"{statistics.median(v):.1f}", f"{statistics.median(v) / raw:.3f}",
             " ".join(f"{r:.1f}" for r in v)] for name, v in rates.items()]
    where = torch.cuda.get_device_name(0) if gpu else f"CPU, {torch.get_num_threads()} threads"
    body = (f"{where}; 2 x Linear({hidden}, {hidden}) + ReLU, batch {batch}, SGD, {args.steps} steps x "
            f"{args.repeats} interleaved repeats, one-rank process group ({'nccl' if gpu else 'gloo'}).\n\n"
            + table(["variant", "median steps/s", "vs raw", "runs"], rows))
    record(f"DDP on one rank ({'GPU' if gpu else 'CPU'}, ddp_one_rank.py)",
           body + (f"\n\n{args.note}" if args.note else ""))


if __name__ == "__main__":
    main()
