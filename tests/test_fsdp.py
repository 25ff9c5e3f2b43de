"""strategy="fsdp": FSDP2 sharding in ctx.setup, real ranks, real gloo; whole models back."""
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

import nbtrain
from conftest import TINY
from nbtrain import WorkerError
from nbtrain.common.inventory import NvmlInventory
from nbtrain.rank.context import Context
from nbtrain.rank.strategies import DEFAULT_MIN_PARAMS, ShardOptions, units

slow = pytest.mark.slow
CPU2 = {"devices": 2, "accelerator": "cpu", "progress": False, "timeout": 120}  # never a hang


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self, width=16, depth=2):
        super().__init__()
        self.inp = torch.nn.Linear(8, width)
        self.blocks = torch.nn.Sequential(*(Block(width) for _ in range(depth)))
        self.out = torch.nn.Linear(width, 4)
        self.register_buffer("scale", torch.full((4,), 2.0), persistent=False)

    def forward(self, x):
        return self.out(self.blocks(self.inp(x))) * self.scale


_seed = torch.Generator().manual_seed(0)  # the same data in ranks that import this module afresh (script, spawn)
DATA = TensorDataset(torch.randn(64, 8, generator=_seed), torch.randint(0, 4, (64,), generator=_seed))


def train(steps=4, **setup):
    ctx = nbtrain.context()
    torch.manual_seed(ctx.rank)  # different starting weights: rank 0's must win, as under DDP
    model = ctx.setup(Net(), **setup)
    opt = torch.optim.Adam(model.parameters(), lr=0.05)
    batches = list(ctx.loader(DATA, batch_size=8))
    for x, y in batches[:steps]:
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def assert_same_weights(a: torch.nn.Module, b: torch.nn.Module):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for key in sa:
        torch.testing.assert_close(sa[key], sb[key], rtol=1e-5, atol=1e-6, msg=key)


# -- units and options, no processes ----------------------------------------------------------

def test_default_units_are_submodules_with_at_least_min_params():
    net = Net(width=16, depth=2)  # a Block holds 16*32+32 + 32*16+16 = 1072 parameters
    assert units(net, ShardOptions.check(min_params=1000)) == list(net.blocks)
    # Sequential holds both blocks' 2144 but they are units already; what is left is 0.
    assert units(net, ShardOptions.check(min_params=2000)) == [net.blocks]
    assert units(net, ShardOptions.check()) == []  # DEFAULT_MIN_PARAMS: a small model is one unit, the root
    assert DEFAULT_MIN_PARAMS == 1_000_000


def test_named_classes_are_the_units_innermost_first():
    net = Net()
    assert units(net, ShardOptions.check(shard=(Block,))) == list(net.blocks)
    linears = [m for m in net.modules() if isinstance(m, torch.nn.Linear)]
    assert units(net, ShardOptions.check(shard=torch.nn.Linear)) == linears


class Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(10, 6)
        self.mid = torch.nn.Linear(6, 6)
        self.head = torch.nn.Linear(6, 10, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, x):
        return self.head(torch.relu(self.mid(self.emb(x))))


def test_a_tied_parameter_is_never_split_between_units():
    net = Tied()
    assert units(net, ShardOptions.check(shard=(torch.nn.Linear, torch.nn.Embedding))) == [net.mid]


@pytest.mark.parametrize("options, words", [
    ({"shard": "Block"}, "shard='Block': give the nn.Module classes to shard one unit each, e.g. shard=(Block,)"),
    ({"shard": ()}, "shard=(): give the nn.Module classes"),
    ({"shard": (int,)}, "shard=(<class 'int'>,): give the nn.Module classes"),
    ({"min_params": 0}, "min_params=0: give an int >= 1"),
    ({"min_params": 1.5}, "min_params=1.5: give an int >= 1"),
    ({"mixed_precision": "bf17"}, "mixed_precision='bf17' is not known. Accepted: None (full precision), 'bf16'"),
    ({"mixed_precision": torch.bfloat16}, "mixed_precision=torch.bfloat16 is not known"),
    ({"cpu_offload": "yes"}, "cpu_offload='yes': give True (parameters, gradients and optimizer state"),
    ({"reshard_after_forward": 1}, "reshard_after_forward=1: give True"),
])
def test_bad_options_say_what_is_accepted(options, words):
    with pytest.raises(ValueError) as info:
        Context().setup(Net(), **options)  # checked under every strategy, so a typo shows on the first run
    assert words in str(info.value)


def test_options_are_accepted_and_unused_by_other_strategies():
    net = Net()
    before = {name: p.detach().clone() for name, p in net.state_dict().items()}
    model = Context().setup(net, shard=(Block,), mixed_precision="bf16", cpu_offload=True)
    # The very module, untouched: not sharded (no FSDP class, no hooks), not cast, not moved.
    assert model is net and type(model) is Net and all(type(b) is Block for b in model.blocks)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    after = model.state_dict()
    assert after.keys() == before.keys()
    assert all(after[k].dtype == before[k].dtype and torch.equal(after[k], before[k]) for k in before)
    x = torch.randn(3, 8)
    assert model(x).dtype == torch.float32  # computed in full precision: bf16 applies under fsdp only


def test_setup_needs_a_module():
    with pytest.raises(TypeError, match="ctx.setup\\(module\\) needs a torch.nn.Module, got list"):
        Context().setup([torch.nn.Linear(2, 2)])


def test_the_strategy_reaches_the_context_through_its_environment_variable():
    env = {"RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2", "NBTRAIN_STRATEGY": "fsdp",
           "NBTRAIN_ACCELERATOR": "cpu"}
    ctx = Context.from_environ(env)
    assert ctx.strategy == "fsdp" and ctx.is_distributed
    assert Context.from_environ({**env, "WORLD_SIZE": "1"}).is_distributed  # one rank still needs a group
    assert Context().prepare_return(value := {"a": [1]}) is value  # other strategies: identity


# -- real ranks -------------------------------------------------------------------------------

def shard_sizes(**setup):
    ctx = nbtrain.context()
    model = ctx.setup(Net(width=64, depth=4), **setup)
    local = sum(p.to_local().numel() for p in model.parameters())
    full = sum(p.numel() for p in model.parameters())
    units = sorted(type(m).__name__ for m in model.modules() if type(m).__name__.startswith("FSDP"))
    return local, full, units


@slow
def test_each_rank_holds_about_half_the_parameters(no_leftovers):
    result = nbtrain.launch(shard_sizes, strategy="fsdp", shard=(Block,), **CPU2)
    (local0, full, units0), (local1, _, units1) = result.values
    assert local0 + local1 == full
    for local in (local0, local1):
        assert abs(local / full - 0.5) < 0.05 * 0.5, (local, full)  # within 5% of 1/N
    assert units0 == units1 == ["FSDPBlock"] * 4 + ["FSDPNet"]


@slow
def test_fsdp_trains_to_the_same_weights_as_ddp(no_leftovers):
    ddp = nbtrain.launch(train, start="fork", **CPU2)
    fsdp = nbtrain.launch(train, strategy="fsdp", shard=(Block,), **CPU2)
    assert fsdp.strategy == "fsdp"
    assert_same_weights(fsdp.value, ddp.value)
    assert not torch.equal(fsdp.value.out.weight, Net().out.weight)  # it did train


def train_and_return_parts():
    model = train(steps=2, shard=(Block,))
    return {"model": model, "parts": (model.blocks[0], 7), "rank": nbtrain.context().rank}


@slow
def test_a_sharded_model_comes_back_whole_on_cpu_from_rank_zero_only(no_leftovers):
    result = nbtrain.launch(train_and_return_parts, strategy="fsdp", **CPU2)
    back, other = result.values
    model = back["model"]
    assert type(model) is Net and type(model.blocks[0]) is Block  # not FSDPNet: plain, picklable modules
    assert all(type(p) is torch.nn.Parameter and p.device.type == "cpu" for p in model.parameters())
    assert model.inp.weight.shape == (16, 8) and model.scale.tolist() == [2.0] * 4  # full; buffer kept
    assert back["parts"] == (model.blocks[0], 7) and back["parts"][0] is model.blocks[0]
    assert other == {"model": None, "parts": (None, 7), "rank": 1}  # no second copy of the model
    fresh = Net()
    fresh.load_state_dict(model.state_dict())
    x = torch.randn(3, 8)
    assert torch.equal(fresh(x), model(x))


def return_tied():
    ctx = nbtrain.context()
    model = ctx.setup(Tied(), shard=(torch.nn.Linear,))
    model(torch.randint(0, 10, (4, 3))).sum().backward()
    return model


@slow
def test_tied_weights_stay_tied_in_the_returned_model(no_leftovers):
    model = nbtrain.launch(return_tied, strategy="fsdp", **CPU2).value
    assert type(model) is Tied and model.head.weight is model.emb.weight


def return_on_rank_zero_only():
    ctx = nbtrain.context()
    model = ctx.setup(Net())
    return model if ctx.is_global_zero else None


@slow
def test_returning_the_model_from_one_rank_only_is_a_clear_error(no_leftovers):
    with pytest.raises(WorkerError) as info:
        nbtrain.launch(return_on_rank_zero_only, strategy="fsdp", **CPU2)
    assert "every rank must return the sharded model, as each holds a part of it" in str(info.value)
    assert "(rank 0: 1, rank 1: 0)" in str(info.value)


def mixed_precision_forward():
    ctx = nbtrain.context()
    net, seen = Net(), []
    net.blocks[0].register_forward_hook(lambda module, args, out: seen.append(out.dtype))
    model = ctx.setup(net, shard=(Block,), mixed_precision="bf16")
    model(torch.randn(4, 8)).sum().backward()
    return seen[0], model.inp.weight.dtype, model.inp.weight.grad.dtype, model


@slow
def test_bf16_mixed_precision_computes_in_bf16_and_keeps_fp32_weights(no_leftovers):
    out_dtype, weight_dtype, grad_dtype, model = nbtrain.launch(mixed_precision_forward, strategy="fsdp", **CPU2).value
    assert out_dtype == torch.bfloat16
    assert weight_dtype == grad_dtype == torch.float32 and model.inp.weight.dtype == torch.float32


@slow
def test_one_rank_fsdp_runs(no_leftovers):
    # As a script: a rank forked alone gets 2 threads, and a forked child that uses the
    # OpenMP pool its parent (this test process) started can hang in its first matmul.
    model = nbtrain.launch(train, strategy="fsdp", **{**CPU2, "devices": 1}, launcher_options={}).value
    assert type(model) is Net


@slow
def test_fsdp_as_a_script_under_torchrun(no_leftovers):
    result = nbtrain.launch(train, strategy="fsdp", start="torchrun", **CPU2)
    ddp = nbtrain.launch(train, strategy="ddp", start="fork", **CPU2)
    assert (result.strategy, result.start) == ("fsdp", "torchrun") and result.values[1] is None
    assert_same_weights(result.value, ddp.value)


@slow
def test_fsdp_picks_its_placement_as_auto_does(capfd, no_leftovers):
    nbtrain.launch(shard_sizes, strategy="fsdp", devices=2, accelerator="cpu", timeout=120)
    assert "nbtrain: fsdp on 2 CPU ranks, gloo (started by fork, chosen by start='auto')\n" in capfd.readouterr().out


@slow
def test_fsdp_ranks_are_spawned_where_fork_is_unsafe(monkeypatch, capfd, no_leftovers):
    # The kernel's state is the input here (on a GPU machine: CUDA initialised in the kernel);
    # the spawned ranks, the shipped job and the gather back are real.
    monkeypatch.setattr(sys.modules["nbtrain.notebook.run.choices"], "fork_blocker", lambda: "CUDA was initialised by a cell")
    try:
        result = nbtrain.launch(train, strategy="fsdp", shard=(Block,), devices=2, accelerator="cpu", timeout=120)
    finally:
        nbtrain.stop_template()  # the warm template the ranks were forked from lives for the session otherwise
    ddp = nbtrain.launch(train, start="fork", **CPU2)
    assert ("nbtrain: fsdp on 2 CPU ranks, gloo (started by template, chosen by start='auto'), "
            "not fork: CUDA was initialised by a cell\n") in capfd.readouterr().out
    assert (result.strategy, result.start) == ("fsdp", "template") and type(result.value) is Net and result.values[1] is None
    assert_same_weights(result.value, ddp.value)


# -- the magic, in a real kernel --------------------------------------------------------------

NOTEBOOK_CELLS = TINY


@slow
def test_a_cell_runs_under_fsdp_through_the_magic(kernel):
    for code in ("%load_ext nbtrain", NOTEBOOK_CELLS):
        _, _, error, _ = kernel.run(code)
        assert error is None, error
    _, err, error, _ = kernel.run("""%%nbtrain --strategy fsdp --devices 2 --accelerator cpu --timeout 120
ctx = nbtrain.context()
torch.manual_seed(ctx.rank)
model = ctx.setup(Tiny(), shard=(torch.nn.Linear,))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for _ in range(3):
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad(); loss.backward(); opt.step()
print("rank", ctx.rank, ctx.strategy, type(model).__name__, sum(p.to_local().numel() for p in model.parameters()), flush=True)
model
""", timeout=180)
    assert error is None, (error, err)
    out, _, _, _ = kernel.run("print(_nbtrain_result.strategy, type(_nbtrain_result.value).__name__, "
                              "_nbtrain_result.values[1], _nbtrain_result.value.a.weight.shape)")
    assert out.strip() == "fsdp Tiny None torch.Size([8, 4])"
    assert kernel.value("isinstance(_nbtrain_result.value, Tiny)") is True  # the notebook's own class
    _, err, _, _ = kernel.run("%%nbtrain --strategy fsdp --launcher accelerate --accelerator cpu\nprint('the cell ran')")
    assert "UsageError: --strategy fsdp runs under torchrun; --launcher accelerate is for --strategy ddp." in err


# -- GPU --------------------------------------------------------------------------------------

HAS_GPU = bool(NvmlInventory().physical_gpus())

GPU_TRAIN = """
import torch, nbtrain
import torch.nn.functional as F

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(4)))
    def forward(self, x):
        return self.blocks(x)

def train(**setup):
    ctx = nbtrain.context()
    model = ctx.setup(Net(), shard=(torch.nn.Linear,), **setup)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(5):
        x = torch.randn(32, 256, device=ctx.device)
        out = model(x)
        loss = F.mse_loss(out.float(), torch.zeros_like(x))
        opt.zero_grad(); loss.backward(); opt.step()
    local = sum(p.to_local().numel() for p in model.parameters())
    return ctx.backend, str(out.dtype), str(model.blocks[0].weight.to_local().device.type), local, model

if __name__ == "__main__":
    n = torch.cuda.device_count()
    for setup in ({"mixed_precision": "bf16"}, {"mixed_precision": "bf16", "cpu_offload": True}):
        r = nbtrain.launch(train, strategy="fsdp", devices=-1, accelerator="gpu", progress=False, timeout=300, **setup)
        backend, dtype, where, local, model = r.values[0]
        assert backend == "nccl" and dtype == "torch.bfloat16", (backend, dtype)
        assert where == ("cpu" if setup.get("cpu_offload") else "cuda"), where
        assert abs(local * n - sum(p.numel() for p in model.parameters())) <= 4 * n * 256
        assert type(model) is Net and next(model.parameters()).device.type == "cpu"
    print("ok", n)
"""


@pytest.mark.gpu
@slow
@pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU with its driver (NVML sees none here)")
def test_gpu_bf16_mixed_precision_over_nccl_and_cpu_offload(tmp_path):
    script = tmp_path / "fsdp_gpu.py"
    script.write_text(textwrap.dedent(GPU_TRAIN))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and run.stdout.splitlines()[-1] == f"ok {torch.cuda.device_count()}", \
        run.stdout + run.stderr
