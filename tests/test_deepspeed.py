"""strategy="deepspeed": the job as a script under DeepSpeed's launcher, ZeRO from a config dict,
on 2 CPU ranks (DeepSpeed's CPU accelerator over gloo); engines come back as plain models."""
import glob
import importlib.util

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import nbtrain
from conftest import TINY

needs_deepspeed = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                     reason="deepspeed is not installed (pip install deepspeed; the test extra has it)")
CPU2 = {"devices": 2, "accelerator": "cpu", "progress": False, "timeout": 600}  # the first run builds DeepSpeed's CPU op


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(8, 16)
        self.b = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


_seed = torch.Generator().manual_seed(0)  # the same data in ranks that import this module afresh
DATA = TensorDataset(torch.randn(64, 8, generator=_seed), torch.randint(0, 4, (64,), generator=_seed))


def train_zero(stage, path):
    import deepspeed

    ctx = nbtrain.context()
    torch.manual_seed(0)
    model = ctx.setup(Net())  # remembers the model's shape: the engine comes back as a plain Net
    config = {"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.05, "weight_decay": 0.0, "torch_adam": True}}}
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    for x, y in list(ctx.loader(DATA, batch_size=8))[:4]:
        loss = F.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        ctx.log("loss", loss, sync_dist=True)
    try:
        ctx.save_checkpoint(path, model=engine)
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return engine, refused


def train_ddp():
    ctx = nbtrain.context()
    torch.manual_seed(0)
    model = ctx.setup(Net())
    optimizer = torch.optim.Adam(model.parameters(), lr=0.05)
    for x, y in list(ctx.loader(DATA, batch_size=8))[:4]:
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model


@pytest.mark.slow
@needs_deepspeed
def test_zero2_trains_as_ddp_does_and_the_engine_comes_back_as_a_plain_model(tmp_path, no_leftovers):
    buffers = set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*"))
    result = nbtrain.launch(train_zero, 2, tmp_path / "c", strategy="deepspeed", **CPU2)
    # DeepSpeed's CPU all-reduce leaves ~70 MB of shared memory per rank: the launch removes its own.
    assert set(glob.glob("/dev/shm/deepspeed_allreduce_buffer_*")) <= buffers
    (model, refused), (other, _) = result.values
    assert result.strategy == "deepspeed" and type(model) is Net and other is None
    assert "a DeepSpeed engine keeps its ZeRO partitions in DeepSpeed's own checkpoint format" in refused
    assert len(result.metrics("loss")) == 4 and result.metrics("loss") == result.metrics("loss", rank=1)
    ddp = nbtrain.launch(train_ddp, start="fork", devices=2, accelerator="cpu", progress=False).value
    for key, value in ddp.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("launch_kwargs, words", [
    ({"strategy": "deepspeed", "launcher_options": {"launcher": "torchrun"}},
     "strategy='deepspeed' runs under DeepSpeed's launcher; launcher='torchrun' is for strategy='ddp'"),
    ({"strategy": "deepspeed", "launcher_options": {"max_restarts": 1}},
     "max_restarts=1: DeepSpeed's launcher does not restart ranks"),
    ({"strategy": "deepspeed", "num_nodes": 2}, "num_nodes=2 needs strategy='ddp' or 'fsdp'"),
    ({"strategy": "ddp", "launcher_options": {"launcher": "deepspeed"}},
     "launcher='deepspeed' runs strategy='deepspeed' (the job calls deepspeed.initialize)"),
])
def test_what_deepspeed_cannot_do_is_refused_before_anything_starts(launch_kwargs, words):
    with pytest.raises(ValueError) as info:
        nbtrain.launch(train_ddp, devices=2, accelerator="cpu", progress=False, **launch_kwargs)
    assert words in str(info.value)


# -- the magic, in a real kernel --------------------------------------------------------------

EARLIER_CELLS = TINY + '''
zero3 = {"train_micro_batch_size_per_gpu": 16, "zero_optimization": {"stage": 3},
         "optimizer": {"type": "Adam", "params": {"lr": 0.01, "torch_adam": True}}}
'''


@pytest.mark.slow
@needs_deepspeed
def test_a_zero3_cell_runs_through_the_magic(kernel):
    for code in ("%load_ext nbtrain", EARLIER_CELLS):
        _, _, error, _ = kernel.run(code)
        assert error is None, error
    out, err, error, _ = kernel.run("""%%nbtrain --strategy deepspeed --devices 2 --accelerator cpu --timeout 600
import deepspeed
ctx = nbtrain.context()
model = ctx.setup(Tiny())
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=zero3)
for _ in range(3):
    loss = F.cross_entropy(engine(x), y)
    engine.backward(loss)
    engine.step()
print("rank", ctx.rank, "holds", sum(p.ds_tensor.numel() for p in engine.module.parameters()), flush=True)
engine
""", timeout=700)
    assert error is None, (error, err)
    full = 4 * 8 + 8 + 8 * 2 + 2
    assert f"[rank 0] rank 0 holds {full // 2}" in out and f"[rank 1] rank 1 holds {full // 2}" in out
    assert kernel.value("type(_nbtrain_result.value).__name__, _nbtrain_result.values[1]") == ("Tiny", None)
    assert kernel.value("isinstance(_nbtrain_result.value, Tiny), tuple(_nbtrain_result.value.a.weight.shape)") == \
        (True, (8, 4))


@pytest.mark.slow
@pytest.mark.parametrize("line, words", [
    ("--strategy deepspeed --max-restarts 1", "max_restarts=1: DeepSpeed's launcher does not restart ranks"),
    ("--strategy deepspeed --launcher accelerate", "strategy='deepspeed' runs under DeepSpeed's launcher"),
    ("--launcher deepspeed", "--launcher deepspeed runs --strategy deepspeed (the cell calls deepspeed.initialize)"),
])
def test_magic_options_deepspeed_cannot_take_are_usage_errors(kernel, line, words):
    _, _, error, _ = kernel.run("%load_ext nbtrain")
    out, err, error, _ = kernel.run(f"%%nbtrain {line} --accelerator cpu\nprint('the cell ran')")
    assert error is None and "the cell ran" not in out
    assert f"UsageError: {words}" in err
