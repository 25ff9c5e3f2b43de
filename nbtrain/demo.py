"""`nbtrain demo`: a small synthetic classification task trained across ranks."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from .rank.context import context

# The live metric: each step's loss averaged across ranks (sync_dist), so every rank shows the same
# value; named for that, apart from each rank's own last-batch loss that `train` returns.
METRIC = "mean_loss"


def synthetic_data(n: int = 2048, features: int = 16, seed: int = 0) -> TensorDataset:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(n, features, generator=generator)
    teacher = torch.randn(features, 2, generator=generator)
    return TensorDataset(x, (x @ teacher).argmax(dim=1))


def make_model(features: int = 16) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Linear(features, 64), torch.nn.ReLU(), torch.nn.Linear(64, 2))


def train(epochs: int = 3, batch_size: int = 64, lr: float = 0.05) -> dict:
    ctx = context()
    torch.manual_seed(0)
    model = ctx.setup(make_model())
    loader = ctx.loader(synthetic_data(), batch_size=batch_size, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss = torch.tensor(0.0)
    for _ in ctx.progress(range(epochs), desc="epoch"):
        for x, y in ctx.progress(loader, desc="batch"):
            x, y = x.to(ctx.device), y.to(ctx.device)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            ctx.log(METRIC, loss, sync_dist=True)
    return {"rank": ctx.rank, "last_batch_loss": loss.item(), "model": model}
