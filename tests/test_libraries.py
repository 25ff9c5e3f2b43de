"""The code people already have, run unchanged on nbtrain's ranks in a real kernel: a Lightning
Trainer, an Accelerate loop, a Transformers Trainer (a tiny model built from a config) and the
PyTorch DDP tutorial, each truly distributed (world size 2, one run over both ranks), through
launch (fork, the warm template, plain spawn, script mode), live ranks and the drop-ins
`nbtrain.spawn` / `nbtrain.notebook_launcher`; and the nested launches a rank refuses."""
import importlib.util

import pytest

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in
                                     ("pytorch_lightning", "accelerate", "transformers")),
                                 reason="needs pytorch-lightning, accelerate and transformers (pip install -e '.[test]')")]

SETUP = '''
%load_ext nbtrain
import os, sys, tempfile, torch, nbtrain
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset
import pytorch_lightning as pl          # imported in the kernel first, as a notebook would
from accelerate import Accelerator
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
from lightning_fabric import Fabric

class Lit(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = nn.Linear(4, 2)
    def training_step(self, batch, _):
        x, y = batch
        return F.mse_loss(self.layer(x), y)
    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

def lightning(strategy="ddp", progress_bar=False):
    torch.manual_seed(int(os.environ["RANK"]))  # different data per rank: equal weights prove DDP ran
    data = DataLoader(TensorDataset(torch.randn(32, 4), torch.randn(32, 2)), batch_size=8)
    model = Lit()
    trainer = pl.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy,
                         max_epochs=1, logger=False, enable_checkpointing=False, enable_model_summary=False,
                         enable_progress_bar=progress_bar)
    trainer.fit(model, data)
    return trainer.world_size, trainer.global_rank, type(trainer.strategy).__name__, float(model.layer.weight.sum())

def accelerate_loop():
    accelerator = Accelerator()
    torch.manual_seed(accelerator.process_index)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = accelerator.prepare(model, opt)
    for _ in range(3):
        loss = F.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 2))
        opt.zero_grad(); accelerator.backward(loss); opt.step()
    weight = float(accelerator.unwrap_model(model).weight.sum())
    return accelerator.num_processes, accelerator.process_index, str(accelerator.distributed_type), weight

class Tokens(Dataset):
    def __len__(self):
        return 16
    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"input_ids": torch.randint(0, 100, (8,), generator=g), "labels": torch.tensor(i % 2)}

def transformers_trainer(progress=False):
    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
                        vocab_size=100)
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, use_cpu=True, per_device_train_batch_size=2,
                                 max_steps=3, report_to=[], save_strategy="no", disable_tqdm=not progress)
        trainer = Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=Tokens())
        trainer.train()
    return args.world_size, str(args.parallel_mode), type(trainer.model_wrapped).__name__, trainer.state.epoch

def fabric_loop(strategy="ddp"):
    fabric = Fabric(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy=strategy)
    fabric.launch()
    torch.manual_seed(fabric.global_rank)  # different data per rank: equal weights prove DDP ran
    model = nn.Linear(4, 2)
    model, opt = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for _ in range(3):
        loss = F.mse_loss(model(torch.randn(8, 4)), torch.randn(8, 2))
        opt.zero_grad(); fabric.backward(loss); opt.step()
    return fabric.world_size, fabric.global_rank, type(fabric.strategy).__name__, float(model.weight.sum())

def fabric_notebook():  # a notebook's Fabric launch: its function runs in processes Fabric forks
    fabric = Fabric(accelerator="cpu", devices=2, strategy="ddp_notebook")
    return fabric.launch(lambda fabric: fabric.global_rank)

def lora_trainer():
    """A Transformers Trainer on a PEFT LoRA model; no use_cpu: a machine without GPUs is enough."""
    import peft
    config = BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=37,
                        vocab_size=100)
    torch.manual_seed(0)  # the same base weights on every rank, as a downloaded model would be
    model = peft.get_peft_model(BertForSequenceClassification(config),
                                peft.LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS"))
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=2, max_steps=3, report_to=[],
                                 save_strategy="no", disable_tqdm=True, learning_rate=0.01)
        trainer = Trainer(model=model, args=args, train_dataset=Tokens())
        trainer.train()
    lora = sum(float(p.detach().sum()) for n, p in model.named_parameters() if "lora_B" in n)
    return args.world_size, str(args.parallel_mode), model.get_nb_trainable_parameters()[0], lora

# The PyTorch DDP tutorial's basic example, as written (CPU: gloo, no device ids).
def setup(rank, world_size):
    os.environ["MASTER_ADDR"] = "localhost"
    os.environ["MASTER_PORT"] = "12355"
    dist.init_process_group("gloo", rank=rank, world_size=world_size)

def cleanup():
    dist.destroy_process_group()

class ToyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.net1 = nn.Linear(10, 10)
        self.relu = nn.ReLU()
        self.net2 = nn.Linear(10, 5)
    def forward(self, x):
        return self.net2(self.relu(self.net1(x)))

def demo_basic(rank, world_size):
    print(f"Running basic DDP example on rank {rank}.")
    setup(rank, world_size)
    model = ToyModel()
    ddp_model = nn.parallel.DistributedDataParallel(model)
    optimizer = torch.optim.SGD(ddp_model.parameters(), lr=0.001)
    optimizer.zero_grad()
    nn.MSELoss()(ddp_model(torch.randn(20, 10)), torch.randn(20, 5)).backward()
    optimizer.step()
    seen = (dist.get_rank(), dist.get_world_size())
    cleanup()
    print(f"Finished running basic DDP example on rank {rank}.")
    return seen

def torchrun_worker():
    """What a library reads to see that it was launched for it."""
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "ROLE_RANK", "TORCHELASTIC_RUN_ID",
            "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_USE_CPU")
    return {k: os.environ.get(k) for k in keys}, hasattr(sys, "ps1")

def libraries_in_turn():
    """Each library in turn in one pair of script ranks: a script rank's imports cost seconds."""
    return torchrun_worker(), lightning(), accelerate_loop(), fabric_loop()

PLACEMENTS = {"fork": dict(start="fork"), "template": dict(start="template"), "spawn": dict(start="spawn"),
              "script": dict(start="torchrun")}

def on(placement, fn, *args):
    return nbtrain.launch(fn, *args, devices=2, accelerator="cpu", progress=False, timeout=240,
                          **PLACEMENTS[placement]).values
'''


@pytest.fixture(scope="module")
def nb():
    from conftest import Kernel

    kernel = Kernel()
    _, _, error, _ = kernel.run(SETUP, timeout=300)
    assert error is None, error
    yield kernel
    kernel.run("nbtrain.stop_template()")
    kernel.close()


def values(kernel, expression, timeout=300):
    _, err, error, _ = kernel.run(f"_values = {expression}", timeout=timeout)
    assert error is None, f"{error['ename']}: {error['evalue']}\n{err[-3000:]}"
    return kernel.value("_values")


def failure(kernel, code, timeout=300) -> str:
    _, _, error, _ = kernel.run(code, timeout=timeout)
    assert error is not None and error["ename"] == "WorkerError", error
    return error["evalue"]


def looks_like_torchrun_workers(seen):
    for rank, (env, interactive) in enumerate(seen):
        assert not interactive, "IPython's prompt would tell Lightning the rank is interactive"
        assert env["RANK"] == env["LOCAL_RANK"] == env["ROLE_RANK"] == str(rank)
        assert env["WORLD_SIZE"] == env["LOCAL_WORLD_SIZE"] == "2" and env["GROUP_RANK"] == "0"
        assert env["TORCHELASTIC_RUN_ID"] and env["MASTER_PORT"] and env["ACCELERATE_USE_CPU"] == "true"


def lightning_joined(seen):
    (world0, rank0, name, weight0), (world1, rank1, _, weight1) = seen
    assert (world0, world1, rank0, rank1, name) == (2, 2, 0, 1, "DDPStrategy")
    assert weight0 == pytest.approx(weight1), "one distributed run: DDP keeps the ranks' weights equal"


def accelerate_joined(seen):
    assert [v[:3] for v in seen] == [(2, 0, "DistributedType.MULTI_CPU"), (2, 1, "DistributedType.MULTI_CPU")]
    assert seen[0][3] == pytest.approx(seen[1][3])


def fabric_joined(seen):
    assert [v[:3] for v in seen] == [(2, 0, "DDPStrategy"), (2, 1, "DDPStrategy")]
    assert seen[0][3] == pytest.approx(seen[1][3])


@pytest.mark.parametrize("placement", ["fork", "template", "spawn"])
def test_every_rank_looks_like_a_torchrun_worker(nb, placement):
    looks_like_torchrun_workers(values(nb, f"on({placement!r}, torchrun_worker)"))


@pytest.mark.parametrize("placement", ["fork", "template"])
@pytest.mark.parametrize("function, joined", [("lightning", lightning_joined), ("accelerate_loop", accelerate_joined),
                                              ("fabric_loop", fabric_joined)], ids=["lightning", "accelerate", "fabric"])
def test_a_lightning_trainer_accelerate_and_fabric_join_the_ranks(nb, placement, function, joined):
    joined(values(nb, f"on({placement!r}, {function})"))


def test_script_ranks_look_like_torchrun_workers_and_lightning_accelerate_and_fabric_join_them(nb):
    # Script mode (start='torchrun'): each library in turn in the same two ranks, each checked as
    # the fork and template cases are; the group the first makes is the one the next ones join.
    worker, lightning, accelerate, fabric = zip(*values(nb, "on('script', libraries_in_turn)"))
    looks_like_torchrun_workers(worker)
    lightning_joined(lightning)
    accelerate_joined(accelerate)
    fabric_joined(fabric)


def test_a_lightning_trainer_with_strategy_auto_joins_the_ranks_too(nb):
    # In a kernel, Lightning turns "auto" into a fork of its own unless the rank is not interactive.
    seen = values(nb, "on('fork', lightning, 'auto')")
    assert [v[:3] for v in seen] == [(2, 0, "DDPStrategy"), (2, 1, "DDPStrategy")]


def test_lightnings_progress_bar_reads_as_one_bar(nb):
    out, err, error, results = nb.run("_r = on('fork', lightning, 'ddp', True)", timeout=300)
    assert error is None, f"{error}\n{err[-2000:]}"
    shown = out + err + "".join(r.get("text/plain", "") for r in results)
    assert 1 <= shown.count("Epoch 0") <= 2, shown  # one bar updated in place, not a line per step
    assert "\r" not in out + err and "\x1b[2K" not in out + err


def test_lightning_ddp_notebook_inside_a_rank_is_refused_naming_the_call(nb):
    message = failure(nb, "on('fork', lightning, 'ddp_notebook')")
    assert "NestedLaunchError: a Lightning Trainer with strategy 'ddp_notebook'" in message, message
    assert "give the Trainer strategy='ddp' (or 'auto') and devices=LOCAL_WORLD_SIZE" in message


def test_a_nested_fabric_ddp_notebook_is_refused_with_fabrics_advice(nb):
    message = failure(nb, "on('fork', fabric_notebook)")
    assert "NestedLaunchError: Lightning Fabric with strategy 'ddp_notebook'" in message, message
    assert "give Fabric strategy='ddp' (or 'auto')" in message and "Trainer" not in message


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="needs peft (pip install -e '.[test]')")
@pytest.mark.parametrize("placement", ["fork", "template"])
def test_a_transformers_trainer_with_peft_lora_joins_the_ranks(nb, placement):
    seen = values(nb, f"on({placement!r}, lora_trainer)")
    assert [v[:2] for v in seen] == [(2, "ParallelMode.DISTRIBUTED")] * 2
    assert seen[0][2] == seen[1][2] > 0
    assert seen[0][3] != 0 and seen[0][3] == pytest.approx(seen[1][3]), "LoRA weights trained, equal on both ranks"


def test_a_rank_that_returns_right_after_its_set_up_never_breaks_the_others(nb):
    # Accelerator() and return: a rank that tore its group down while its peer still connected its
    # gloo mesh failed that peer ("connectFullMesh failed ... Connection closed by peer", 1 launch
    # in 120). Every rank now leaves the set-up only once all are connected (torch's init barrier):
    # the variable that asks for it is read in every rank, which fails at once without the fix; the
    # launches are a few of the race's own chances, not a search for it (60 cost 30 s of CPU).
    runs = values(nb, "[on('template', lambda: (Accelerator(), os.environ['TORCH_DIST_INIT_BARRIER'])[1]) "
                      "for _ in range(12)]", timeout=600)
    assert runs == [["1", "1"]] * 12


def test_nbtrain_notebook_launcher_runs_an_accelerate_function(nb):
    seen = values(nb, "nbtrain.notebook_launcher(accelerate_loop, num_processes=2, progress=False).values")
    assert [v[:2] for v in seen] == [(2, 0), (2, 1)]


def test_accelerate_notebook_launcher_inside_a_rank_is_refused_naming_the_call(nb):
    message = failure(nb, "from accelerate import notebook_launcher\n"
                          "on('fork', lambda: notebook_launcher(accelerate_loop, num_processes=2))")
    assert "NestedLaunchError: accelerate's notebook_launcher was called inside an nbtrain rank" in message, message
    assert "notebook_launcher(fn, args, num_processes=N) (from nbtrain.notebook.dropins) from the notebook" in message


@pytest.mark.parametrize("placement", ["fork", "template"])
def test_a_transformers_trainer_joins_the_ranks(nb, placement):
    seen = values(nb, f"on({placement!r}, transformers_trainer)")
    # 16 samples, 2 per device on 2 ranks: 3 steps are 0.75 of an epoch only if the sampler splits the data.
    assert seen == [(2, "ParallelMode.DISTRIBUTED", "DistributedDataParallel", 0.75)] * 2


def test_the_transformers_notebook_progress_table_shows_once(nb):
    # In a rank forked from the kernel, Transformers draws its HTML progress table (as under
    # notebook_launcher): rank 0's reaches the cell as rich output; rank 1's is counted, not shown.
    out, err, error, results = nb.run("_r = on('fork', transformers_trainer, True)", timeout=300)
    assert error is None, f"{error}\n{err[-2000:]}"
    tables = [r["text/html"] for r in results if "<progress" in r.get("text/html", "")]
    assert tables, results
    assert "rank 1 displayed" in out + err  # said once, not shown twice


@pytest.mark.parametrize("start_method", ["spawn", "fork"])
def test_the_ddp_tutorial_runs_under_nbtrain_spawn(nb, start_method):
    out, err, error, _ = nb.run(f"_r = nbtrain.spawn(demo_basic, args=(2,), nprocs=2, start_method={start_method!r})",
                                timeout=300)
    assert error is None, f"{error}\n{err[-2000:]}"
    assert nb.value("_r.values") == [(0, 2), (1, 2)]
    assert "[rank 1] Finished running basic DDP example on rank 1." in out + err


def test_the_ddp_tutorial_sets_its_own_port_under_torchrun(nb):
    # torchrun's ranks wait for its agent's store; the tutorial's own MASTER_PORT is honoured instead.
    out, err, error, _ = nb.run("%%nbtrain --start torchrun --devices 2 --accelerator cpu --timeout 120\n"
                                "demo_basic(int(os.environ['RANK']), 2)", timeout=300)
    assert error is None, f"{error}\n{err[-2000:]}"
    assert nb.value("_nbtrain_result.values") == [(0, 2), (1, 2)]


def test_live_ranks_take_the_tutorials_own_init_process_group(nb):
    _, err, error, _ = nb.run("ranks = nbtrain.Ranks(devices=2, accelerator='cpu')\n"
                              "ranks.exec(\"os.environ['MASTER_PORT'] = '12355'\\n"
                              "dist.init_process_group('gloo', rank=int(os.environ['RANK']), world_size=2)\")")
    try:
        assert error is None, f"{error}\n{err[-2000:]}"
        assert nb.value("ranks.eval('dist.get_world_size()')") == [2, 2]
        _, _, error, _ = nb.run("ranks.exec(\"dist.init_process_group('gloo', rank=0, world_size=3)\")")
        assert error is not None and "init_process_group(world_size=3 (the group has 2)" in error["evalue"], error
    finally:
        nb.run("ranks.close()")


def test_mp_spawn_inside_a_rank_is_refused_naming_the_call(nb):
    message = failure(nb, "import torch.multiprocessing as mp\non('fork', lambda: mp.spawn(print, nprocs=2))")
    assert "NestedLaunchError: torch.multiprocessing.spawn / start_processes was called inside an nbtrain rank" in message
    assert "spawn(fn, args=..., nprocs=N) (from nbtrain.notebook.dropins) from the notebook" in message


def test_drop_ins_refuse_what_they_cannot_do(nb):
    for code, said in [("nbtrain.spawn(demo_basic, args=(2,), nprocs=2, join=False)", "spawn(join=False)"),
                       ("nbtrain.spawn(demo_basic, args=2, nprocs=2)", "give a tuple"),
                       ("nbtrain.spawn(demo_basic, nprocs=0)", "nprocs=0"),
                       ("nbtrain.spawn(demo_basic, nprocs=2, start_method='thread')", "start_method='thread'"),
                       ("nbtrain.notebook_launcher(accelerate_loop, num_nodes=2)", "num_nodes=2"),
                       ("nbtrain.notebook_launcher(accelerate_loop, mixed_precision='fp4')", "mixed_precision='fp4'")]:
        _, _, error, _ = nb.run(code)
        assert error is not None and said in error["evalue"], (code, error)
