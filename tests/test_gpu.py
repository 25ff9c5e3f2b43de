"""GPU paths: nccl, DataParallel, CUDA ranks, NVML. They run where a GPU is visible and skip
elsewhere, saying why. On the CPU-only CI machine the same selection logic is covered through
the injectable inventory (test_devices.py, test_inventory.py)."""
import subprocess
import sys
import textwrap

import pytest

from nbtrain.common.inventory import NvmlInventory

HAS_GPU = bool(NvmlInventory().physical_gpus())
pytestmark = [pytest.mark.gpu, pytest.mark.slow,
              pytest.mark.skipif(not HAS_GPU, reason="needs an NVIDIA GPU with its driver (NVML sees none here)")]


def run_fresh(code: str, timeout: float = 300) -> str:
    """A fresh interpreter: CUDA state in one test must not leak into the next (fork safety)."""
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=timeout)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout


TRAIN = """
import torch, nbtrain
import torch.nn.functional as F

def train():
    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Linear(32, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in ctx.progress(range(20)):
        x = torch.randn(64, 32, device=ctx.device)
        loss = F.mse_loss(model(x), torch.zeros(64, 4, device=ctx.device))
        opt.zero_grad(); loss.backward(); opt.step()
        ctx.log("loss", loss, sync_dist=True)
    return type(model).__name__, str(ctx.device), ctx.backend, torch.cuda.get_device_name(ctx.device), model
"""


@pytest.mark.parametrize("how, wrapper", [('start="fork"', "DistributedDataParallel"),
                                          ('start="template"', "DistributedDataParallel"),
                                          ('strategy="dp"', "DataParallel"),
                                          ('strategy="auto"', "Linear")])
def test_training_on_the_gpu(how, wrapper):
    out = run_fresh(TRAIN + f"""
r = nbtrain.launch(train, devices=1, accelerator="gpu", {how}, progress=False)
name, device, backend, gpu, model = r.value
assert name == "{wrapper}", name
assert device == "cuda:0" and next(model.parameters()).device.type == "cpu"
assert len(r.metrics("loss")) == 20
print("OK", r.strategy, backend, gpu, f"{{r.elapsed:.2f}}s")
""")
    assert "\nOK " in "\n" + out
    print(out)


def test_nccl_is_the_gpu_default_and_fork_after_cuda_init_is_refused():
    out = run_fresh(TRAIN + """
r = nbtrain.launch(train, devices=1, accelerator="gpu", start="fork", progress=False)
assert r.value[2] == "nccl"
torch.zeros(1, device="cuda")   # the kernel now holds a CUDA context
try:
    nbtrain.launch(train, devices=1, accelerator="gpu", start="fork", progress=False)
except RuntimeError as exc:
    assert "CUDA is already initialised" in str(exc) and "start='template'" in str(exc), exc
    print("REFUSED", str(exc).splitlines()[0][:200])
r = nbtrain.launch(train, devices=1, accelerator="gpu", progress=False)   # auto: in-process still fine
print("OK", r.strategy)
""")
    assert "REFUSED" in out and "OK single" in out
    print(out)


def test_nvml_inventory_matches_torch():
    out = run_fresh("""
import nbtrain, torch
seen = nbtrain.gpus()
print(seen)
assert len(seen) == torch.cuda.device_count()
assert seen[0].name == torch.cuda.get_device_name(0), (seen[0].name, torch.cuda.get_device_name(0))
print("OK")
""")
    assert "OK" in out
    print(out)


def test_cuda_in_the_kernel_then_ddp_starts_its_ranks_from_the_template():
    out = run_fresh(TRAIN + """
import os, nbtrain.placements.template_process
torch.zeros(1, device="cuda")                      # the kernel touched the GPU: forking it is unsafe
result = nbtrain.launch(train, devices=1, strategy="ddp", progress=False)   # start="auto"
print(result.strategy, result.start, result.value[:3], torch.cuda.device_count())
def where():
    return os.getppid()
parents = nbtrain.launch(where, devices=1, strategy="ddp", progress=False).values
print("template parent:", parents == [nbtrain.placements.template_process.template(start=False).pid])
""")
    assert "ddp template ('DistributedDataParallel', 'cuda:0', 'nccl')" in out
    assert "template parent: True" in out


def test_live_ranks_on_the_gpu_with_cuda_initialised_in_the_kernel():
    out = run_fresh("""
import torch, nbtrain
torch.zeros(1, device="cuda")
with nbtrain.Ranks(devices=1) as ranks:
    print("placement", ranks.placement)
    ranks.exec("import torch.distributed as dist\\nx = torch.ones(4, device=ctx.device)\\ndist.all_reduce(x)")
    print("backend", ranks.eval("dist.get_backend()"), ranks.eval("str(x.device)"))
    print("pulled", ranks.pull("x")[0].device)
    print("memory", ranks.eval("torch.cuda.max_memory_allocated() > 0"))
""")
    assert "placement template" in out and "backend ['nccl'] ['cuda:0']" in out
    assert "pulled cpu" in out and "memory [True]" in out


def test_a_real_kernel_that_used_cuda_trains_on_the_gpu_through_the_magic_and_launch(kernel):
    """What Accelerate's notebook launcher fails on ("Cannot re-initialize CUDA in forked
    subprocess"), in a real Jupyter kernel: CUDA used in a cell, then a DDP launch and a
    `%%nbtrain` cell on the GPU."""
    cells = [TRAIN, "torch.zeros(1, device='cuda'); print(torch.cuda.is_initialized())",
             "r = nbtrain.launch(train, devices=1, strategy='ddp', progress=False)\n"
             "print(r.strategy, r.start, r.value[:3])",
             "%load_ext nbtrain",
             "%%nbtrain --devices 1 --accelerator gpu --strategy ddp\n"
             "ctx = nbtrain.context(); ctx.start_group()\n"
             "x = torch.ones(4, device=ctx.device); torch.distributed.all_reduce(x); print(x.device, ctx.backend)"]
    said = []
    for cell in cells:
        out, err, error, _ = kernel.run(cell, timeout=240)
        assert error is None, (cell, error, err)
        said.append(out)
    assert said[1].strip() == "True"
    assert "ddp template ('DistributedDataParallel', 'cuda:0', 'nccl')" in said[2], said[2]
    assert "(started by template" in said[4] and "[rank 0] cuda:0 nccl" in said[4], said[4]


def test_a_sweep_and_a_map_run_their_trials_and_workers_on_the_gpu(tmp_path):
    """Wave 4's many-runs paths on a real GPU: each sweep trial and each map worker is its own
    process on its slot's GPU (CUDA_VISIBLE_DEVICES narrowed to it), and `Ranks.map` runs on live
    CUDA ranks with the model they hold."""
    out = run_fresh("""
import os, optuna, torch, nbtrain
from optuna.distributions import FloatDistribution
optuna.logging.set_verbosity(optuna.logging.WARNING)

def fit(lr):
    ctx = nbtrain.context()
    model = torch.nn.Linear(8, 1).to(ctx.device)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    x = torch.randn(64, 8, device=ctx.device); y = x.sum(1, keepdim=True)
    for step in range(10):
        loss = torch.nn.functional.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        ctx.log("loss", loss, step=step)
    return str(next(model.parameters()).device), os.environ.get("CUDA_VISIBLE_DEVICES")

search = nbtrain.sweep(fit, {"lr": FloatDistribution(1e-3, 0.1, log=True)}, trials=2, metric="loss",
                       accelerator="gpu", progress=False, run_dir=RUN_DIR)
print("sweep", len(search.study.trials), search.best_result.value, search.best_value < 1e9)

def where(x):
    return str(x.cuda().device), float(x.cuda().sum())
print("map", nbtrain.map(where, [torch.ones(3), torch.ones(5)], accelerator="gpu", progress=False))

torch.zeros(1, device="cuda")                  # CUDA in the kernel: live ranks from the template
with nbtrain.Ranks(devices=1, progress=False) as ranks:
    ranks.exec("model = torch.nn.Linear(4, 1, bias=False).to(ctx.device); torch.nn.init.ones_(model.weight)")
    def predict(x):
        with torch.no_grad():
            return str(model.weight.device), float(model(x.to(model.weight.device)).sum())
    print("ranks.map", ranks.map(predict, [torch.ones(2, 4), torch.ones(1, 4)]))
""".replace("RUN_DIR", repr(str(tmp_path / "sweep"))))
    print(out)
    assert "sweep 2 ('cuda:0', '0') True" in out, out
    assert "map [('cuda:0', 3.0), ('cuda:0', 5.0)]" in out, out
    assert "ranks.map [('cuda:0', 8.0), ('cuda:0', 4.0)]" in out, out


NOTES = """
import re, statistics, time, torch, nbtrain
import torch.distributed as dist
import torch.nn.functional as F
from nbtrain.display.text import QuietDisplay
from nbtrain.rank import flight_recorder

class Notes(QuietDisplay):   # keeps what the run said (the doctor's note among it)
    def __init__(self):
        super().__init__()
        self.notes = []
    def note(self, text):
        self.notes.append(text)
"""


def test_nccls_flight_recorder_is_read_back_and_said_in_a_stall():
    """The doctor's reading of NCCL's Flight Recorder (rank/flight_recorder.py) on one GPU: after DDP
    steps it holds DDP's bucket all-reduces (issued by DDP's C++ reducer) and names the last
    collective, completed, by its sequence number; and a DDP all-reduce queued behind a long GPU
    kernel (issued, not completed, as a collective waiting for a late peer is) is said in the verdict."""
    out = run_fresh(NOTES + """
STEPS = 5

def readback():
    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Linear(32, 4))                     # one bucket: 132 floats
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        loss = F.mse_loss(model(torch.randn(64, 32, device=ctx.device)), torch.zeros(64, 4, device=ctx.device))
        opt.zero_grad(); loss.backward(); opt.step()
    torch.cuda.synchronize()
    after_ddp = flight_recorder.summary()
    dist.all_reduce(torch.ones(7, 3, device=ctx.device))
    torch.cuda.synchronize()
    last = flight_recorder.summary()
    entries = flight_recorder._read(flight_recorder._dump_function(), False).get("entries", [])
    buckets = sum(e["profiling_name"].endswith("all_reduce") and e["input_sizes"] == [[132]] for e in entries)
    return after_ddp, last, buckets

after_ddp, last, buckets = nbtrain.launch(readback, devices=1, accelerator="gpu", start="fork", progress=False).value
print("after DDP", after_ddp); print("last", last); print("bucket all-reduces", buckets)
assert after_ddp[:6] == ("all_reduce", after_ddp[1], ((132,),), ("Float",), "default_pg", "completed"), after_ddp
assert last == ("all_reduce", after_ddp[1] + 1, ((7, 3),), ("Float",), "default_pg", "completed", 0), last
assert buckets >= STEPS, buckets

def queued_behind_a_kernel():
    ctx = nbtrain.context()
    model = ctx.setup(torch.nn.Linear(32, 4))
    x = torch.randn(64, 32, device=ctx.device)
    for _ in range(3):
        model(x).sum().backward()
    loss = model(x).sum()
    torch.cuda._sleep(50_000_000_000)   # ~25 s of GPU cycles (at 2 GHz): what follows on the GPU waits
    loss.backward()                     # DDP's all-reduce issued, queued behind the sleeping kernel
    done = torch.cuda.Event(); done.record()
    while not done.query():
        time.sleep(0.05)
    return "done"

notes = Notes()   # stall=8: well past CUDA's and NCCL's start, which make no progress either
value = nbtrain.launch(queued_behind_a_kernel, devices=1, accelerator="gpu", start="fork", progress=notes, stall=8,
                       timeout=150).value
said = [n for n in notes.notes if n.startswith("No rank has progressed")]
print("verdict", said)
assert value == "done" and len(said) == 1, notes.notes
assert re.search(r"NCCL's flight recorder: rank 0 (issued|started) all_reduce #[0-9]+ [(]Float[[]132[]], default_pg[)], "
                 r"not completed", said[0]), said[0]
print("OK")
""")
    print(out)
    assert "\nOK" in "\n" + out


def test_the_doctors_costs_on_a_real_ddp_step_are_printed():
    """What the doctor costs on a real DDP step on the GPU, printed (measured, not asserted): the
    counting communication hook against torch's built-in all-reduce on the same model, interleaved;
    and reading NCCL's Flight Recorder on a stall (`summary`) with hundreds of entries in it."""
    out = run_fresh(NOTES + """
from torch.nn.parallel import DistributedDataParallel as DDP

def costs():
    ctx = nbtrain.context(); ctx.start_group()
    def model(builtin):
        torch.manual_seed(0)
        ddp = DDP(torch.nn.Sequential(*[torch.nn.Linear(2048, 2048) for _ in range(8)]).to(ctx.device),
                  device_ids=[ctx.device])
        if builtin:   # torch's own C++ all-reduce, before the first forward: nbtrain leaves it uncounted
            ddp._register_builtin_comm_hook(dist.BuiltinCommHookType.ALLREDUCE)
        return ddp
    models = {"counted": model(False), "builtin": model(True)}
    x = torch.randn(256, 2048, device=ctx.device)
    def steps(m, n=5):
        torch.cuda.synchronize(); began = time.perf_counter()
        for _ in range(n):
            m(x).square().mean().backward()
        torch.cuda.synchronize()
        return (time.perf_counter() - began) / n
    for m in models.values():
        steps(m)
    times = {k: [] for k in models}
    for _ in range(30):
        for k, m in models.items():
            times[k].append(steps(m))
    reads = []
    for _ in range(5):
        began = time.perf_counter(); said = flight_recorder.summary(); reads.append(time.perf_counter() - began)
    full = time.perf_counter()
    entries = len(flight_recorder._read(flight_recorder._dump_function(), False).get("entries", []))
    full = time.perf_counter() - full
    return {k: statistics.median(v) for k, v in times.items()}, statistics.median(reads), full, entries, said

step, read, full, entries, said = nbtrain.launch(costs, devices=1, accelerator="gpu", start="fork",
                                                 progress=False).value
extra = step["counted"] - step["builtin"]
print(f"DDP step (8x Linear(2048), batch 256, one H200): counting hook {step['counted'] * 1e3:.3f} ms, "
      f"torch's built-in {step['builtin'] * 1e3:.3f} ms: {extra * 1e6:+.0f} us ({extra / step['builtin']:+.1%})")
print(f"flight recorder: summary {read * 1e3:.2f} ms, full dump of {entries} entries {full * 1e3:.2f} ms; {said}")
assert said and entries > 0
print("OK")
""")
    print(out)
    assert "\nOK" in "\n" + out


def test_trials_that_share_a_gpu_run_on_it_together_and_each_reports_the_memory_it_held():
    """`trials_per_device=2` on one GPU: two slots, each its own warm process on cuda:0 (the GPU
    narrowed to it), trials of the two slots running at the same time; each trial's own GPU
    memory (NVML's figure for its process) in the study, its row and the summary."""
    out = run_fresh("""
import json, optuna, nbtrain
from nbtrain.notebook.many.sweep_study import GPU_MEMORY
optuna.logging.set_verbosity(optuna.logging.WARNING)

def holds_memory(trial):
    import os, time, torch
    started = time.time()
    held = torch.empty(768 << 20, dtype=torch.uint8, device="cuda")  # 768 MiB, past a vitals interval
    time.sleep(2.5)
    trial.set_user_attr("ran", [started, time.time(), os.getpid(), str(held.device),
                                os.environ.get("CUDA_VISIBLE_DEVICES")])
    del held
    return trial.suggest_float("x", 0.0, 1.0)

swept = nbtrain.sweep(holds_memory, trials=4, devices=[0], trials_per_device=2, accelerator="gpu",
                      study=optuna.create_study(), progress=False)
trials = [[t.state.name, t.user_attrs.get("nbtrain_slot"), t.user_attrs.get(GPU_MEMORY), t.user_attrs.get("ran")]
          for t in swept.study.get_trials()]
print("RESULT", json.dumps({"trials": trials, "details": [r.detail for r in swept.state.rows.values()],
                            "summary": repr(swept)}))
""")
    import json

    found = json.loads(out.split("RESULT ", 1)[1])
    trials = found["trials"]
    assert [state for state, *_ in trials] == ["COMPLETE"] * 4, out
    assert {slot for _, slot, *_ in trials} == {"GPU 0 (slot 0)", "GPU 0 (slot 1)"}, out
    assert all(ran[3:] == ["cuda:0", "0"] for *_, ran in trials), out  # on the GPU given, narrowed to it
    assert len({ran[2] for *_, ran in trials}) == 2, out  # one warm process per slot, both on GPU 0
    together = [(a, b) for a in trials for b in trials
                if a[1] != b[1] and a[3][0] < b[3][1] and b[3][0] < a[3][1]]
    assert together, out  # trials of the two slots held the GPU at the same time
    assert all(memory >= 768 << 20 for _, _, memory, _ in trials), out  # each trial's own, not the GPU's total
    held = [float(detail.split()[2]) for detail in found["details"] if detail.startswith("GPU memory ")]
    assert len(held) == 4 and all(g >= 0.75 for g in held), found["details"]
    assert found["summary"].count("GPU memory") >= 4, found["summary"]  # the summary's rows say it too
