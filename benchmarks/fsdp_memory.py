"""Per-rank memory under strategy="fsdp" against DDP.

CPU (default): each rank's share of the parameters, gradients and Adam state, from the sizes
of the tensors it holds after a few training steps (FSDP2's local shards; DDP's full
replicas), on 2 and 4 CPU ranks. Goal: the parameter share within 5% of 1/N.

GPU (`--gpu`, needs 2 or more NVIDIA GPUs and a CUDA torch): peak GPU memory per rank
(torch.cuda.max_memory_allocated) under DDP and fsdp; then every rank's memory is capped
between the two peaks (torch.cuda.set_per_process_memory_fraction): DDP must run out of
memory and fsdp must train.

    python benchmarks/fsdp_memory.py [--ranks 2 4] [--gpu]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
import nbtrain  # noqa: E402
from _common import record, table  # noqa: E402

STEPS = 3


class Block(torch.nn.Module):
    """A transformer block's parameters: attention projections and a 4x MLP."""

    def __init__(self, width: int):
        super().__init__()
        self.norm1, self.norm2 = torch.nn.LayerNorm(width), torch.nn.LayerNorm(width)
        self.attn = torch.nn.MultiheadAttention(width, 8, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(width, 4 * width), torch.nn.GELU(),
                                       torch.nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class Model(torch.nn.Module):
    def __init__(self, width: int, depth: int, vocab: int = 1000):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.blocks = torch.nn.Sequential(*(Block(width) for _ in range(depth)))
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens)))


def _local(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def cpu_train(width: int, depth: int):
    ctx = nbtrain.context()
    torch.manual_seed(0)
    model = ctx.setup(Model(width, depth), shard=(Block,))
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(STEPS):
        tokens = torch.randint(0, 1000, (4, 32))
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        opt.zero_grad(set_to_none=False)  # gradients stay allocated: they count
        loss.backward()
        opt.step()
    params = [p for p in model.parameters()]
    return {
        "params": sum(_local(p) for p in params),
        "grads": sum(_local(p.grad) for p in params if p.grad is not None),
        "optimizer": sum(_local(v) for state in opt.state.values() for v in state.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0),
        "full": sum(p.numel() * p.element_size() for p in params),
    }


def mb(n: float) -> str:
    return f"{n / 2**20:.1f}"


def cpu(ranks: list[int], width: int, depth: int) -> None:
    rows = []
    for n in ranks:
        ddp = nbtrain.launch(cpu_train, width, depth, strategy="ddp_fork", devices=n, accelerator="cpu",
                             progress=False).values
        fsdp = nbtrain.launch(cpu_train, width, depth, strategy="fsdp", devices=n, accelerator="cpu",
                              progress=False).values
        for name, values in (("ddp_fork", ddp), ("fsdp", fsdp)):
            worst = max(values, key=lambda v: v["params"])
            total = worst["params"] + worst["grads"] + worst["optimizer"]
            ddp_total = ddp[0]["params"] + ddp[0]["grads"] + ddp[0]["optimizer"]
            share = worst["params"] / worst["full"]
            against = f" ({abs(share * n - 1) * 100:.2f}% from 1/N = {1 / n:.4f})" if name == "fsdp" else ""
            rows.append([name, str(n), mb(worst["full"]), mb(worst["params"]), f"{share:.4f}{against}",
                         mb(worst["grads"]), mb(worst["optimizer"]), mb(total), f"{total / ddp_total:.3f}"])
    params = sum(p.numel() for p in Model(width, depth).parameters())
    body = (f"Transformer-like model ({depth} blocks of width {width}, vocabulary 1000; {params / 1e6:.1f}M fp32 "
            f"parameters), `ctx.setup(model, shard=(Block,))`, Adam, {STEPS} steps on CPU ranks (gloo). Sizes of the "
            "tensors each rank holds after training (FSDP2: its local shards; DDP: full replicas), on the rank "
            "holding the most; DDP's gradient buckets (one more gradient-sized copy) not counted.\n\n")
    body += table(["strategy", "ranks N", "model MB", "params MB / rank", "param share", "grads MB / rank",
                   "Adam state MB / rank", "total MB / rank", "vs DDP"], rows)
    body += ("\n\nGoal: per-rank parameter share within 5% of 1/N. Before sharding every rank builds the whole model "
             "(on CPU, as the user's code constructs it); what fsdp saves is what the rank holds while it trains. "
             "Shared machine (other engineers' tests running), which does not change sizes.")
    record("FSDP memory per rank (fsdp_memory.py, CPU)", body)


# -- GPU ------------------------------------------------------------------------------------

def gpu_train(width: int, depth: int, fraction: float | None):
    ctx = nbtrain.context()
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, ctx.device)
    torch.manual_seed(0)
    model = ctx.setup(Model(width, depth), shard=(Block,))  # built on CPU: ctx.setup moves (and shards) it
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    for _ in range(STEPS):
        tokens = torch.randint(0, 1000, (4, 32), device=ctx.device)
        loss = F.cross_entropy(model(tokens).flatten(0, 1), tokens.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(ctx.device), torch.cuda.get_device_properties(ctx.device).total_memory


def gpu(width: int, depth: int) -> None:
    n = torch.cuda.device_count()
    if n < 2:
        sys.exit(f"--gpu needs 2 or more GPUs to shard across (this machine has {n}).")
    peaks = {}
    for name in ("ddp_spawn", "fsdp"):
        values = nbtrain.launch(gpu_train, width, depth, None, strategy=name, devices=n, accelerator="gpu",
                                progress=False).values
        peaks[name] = max(v[0] for v in values)
        total = values[0][1]
    cap = (peaks["ddp_spawn"] + peaks["fsdp"]) / 2
    outcome = {}
    for name in ("ddp_spawn", "fsdp"):
        try:
            nbtrain.launch(gpu_train, width, depth, cap / total, strategy=name, devices=n, accelerator="gpu",
                           progress=False)
            outcome[name] = "trains"
        except nbtrain.WorkerError as exc:
            outcome[name] = "out of memory" if "OutOfMemoryError" in str(exc) else f"failed: {str(exc).splitlines()[0]}"
    rows = [[name, str(n), mb(peaks[name]), outcome[name]] for name in peaks]
    body = (f"Model of fsdp_memory.py ({depth} blocks of width {width}), Adam, {STEPS} steps, {n} GPUs, "
            f"{torch.cuda.get_device_name(0)}. Peak = torch.cuda.max_memory_allocated on the rank with the most. "
            f"Cap: torch.cuda.set_per_process_memory_fraction at {mb(cap)} MB per GPU, between the two peaks.\n\n")
    body += table(["strategy", "GPUs", "peak MB / GPU", f"capped at {mb(cap)} MB"], rows)
    body += "\n\nGoal: DDP runs out of memory under the cap, fsdp trains."
    record("FSDP memory per GPU (fsdp_memory.py --gpu)", body)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--width", type=int, default=512)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--gpu", action="store_true", help="peak GPU memory and the memory-cap run (2+ GPUs)")
    args = parser.parse_args()
    if args.gpu:
        gpu(args.width, args.depth)
    else:
        cpu(args.ranks, args.width, args.depth)


if __name__ == "__main__":
    main()
