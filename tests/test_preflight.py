"""Fork preflight: naming what initialised CUDA, offender modules, and NCCL's P2P quirk.

CUDA cannot initialise on the CPU-only CI machine, and there `torch.cuda._lazy_init()` raises
before it runs its queued calls. So these tests take the real path up to that point: they run
the recorder that `import nbtrain` queued in `torch.cuda._queued_calls`, from a named line,
exactly as `_lazy_init` would; then they stand in for torch's "initialised" flag through the
`preflight.cuda_is_initialized` seam. The GPU test at the end initialises CUDA for real.
"""
import importlib
import os
import pickle
import subprocess
import sys
import textwrap

import pytest
import torch

import nbtrain
from nbtrain.common import preflight
from nbtrain.common.devices import DevicePlan, plan_devices
from nbtrain.common.inventory import Gpu, GpuProcess, StaticInventory, use_inventory
from nbtrain.common.preflight import CudaInit, ForkUnsafeError, Frame
from nbtrain.notebook.run.choices import choose, words
from nbtrain.placements.base import Job, ProcessLauncher, rank_environ

# What torch.cuda._lazy_init does with its queue, limited to nbtrain's recorder: on a GPU
# machine torch's own queued checks would really initialise CUDA in the test process.
RUN_QUEUED = "[call() for call, _ in torch.cuda._queued_calls if getattr(call, 'nbtrain_recorder', False)]"


@pytest.fixture
def cuda_state(monkeypatch):
    """A clean record, and a switch standing for torch's 'CUDA is initialised' flag."""
    monkeypatch.setattr(preflight, "_first_init", None)
    flag = {"on": False}
    monkeypatch.setattr(preflight, "cuda_is_initialized", lambda: flag["on"])
    return flag


@pytest.fixture
def fake_module(tmp_path, monkeypatch):
    """Write real module files on sys.path (`write("pkg/mod.py", source)`); what they import is
    removed from sys.modules afterwards."""
    monkeypatch.syspath_prepend(str(tmp_path))

    def write(relative: str, source: str) -> None:
        path = tmp_path / relative
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
        importlib.invalidate_caches()

    yield write
    for name, module in list(sys.modules.items()):
        if str(getattr(module, "__file__", None) or "").startswith(str(tmp_path)):
            del sys.modules[name]


def cpu_plan(n=2):
    return plan_devices(n, "cpu", None, 1)


# --- the hook -----------------------------------------------------------------------------------

def recorders():
    return [call for call, _ in torch.cuda._queued_calls if getattr(call, "nbtrain_recorder", False)]


def test_import_queues_one_recorder_and_a_second_install_is_harmless():
    assert len(recorders()) == 1
    assert preflight.install_cuda_init_hook() is True  # what %load_ext nbtrain does again
    assert len(recorders()) == 1


def initialise_cuda_here():
    # What torch.cuda._lazy_init does with its queue (RUN_QUEUED, written out).
    [call() for call, _ in torch.cuda._queued_calls if getattr(call, "nbtrain_recorder", False)]


NAMED_LINE = initialise_cuda_here.__code__.co_firstlineno + 2


def test_recorder_names_the_line_and_fork_is_refused(cuda_state):
    assert preflight.fork_blocker() is None
    initialise_cuda_here()
    cuda_state["on"] = True
    record = preflight.recorded_cuda_init()
    assert record.pid == os.getpid() and record.thread == "MainThread"
    reason = preflight.fork_blocker()
    assert reason == (f"CUDA is already initialised in this kernel, at test_preflight line {NAMED_LINE} "
                      "(`[call() for call, _ in torch.cuda._queued_calls if getattr(call, \"nbtrain_recorder\", "
                      "False)]`)")
    with pytest.raises(ForkUnsafeError) as refused:
        preflight.check_fork()
    text = str(refused.value)
    assert text.startswith(f"start='fork' refused: {reason}; a forked rank cannot initialise CUDA again")
    assert "Cannot re-initialize CUDA in forked subprocess" in text
    assert "restart the kernel" in text and "start='template', 'spawn' or 'torchrun'" in text


def test_a_record_alone_refuses_fork(cuda_state):
    # The recorder runs only after torch initialised the driver, even if a later queued call failed.
    initialise_cuda_here()
    assert "CUDA is already initialised" in preflight.fork_blocker()


def test_initialised_before_the_hook_says_so(cuda_state):
    cuda_state["on"] = True
    assert preflight.fork_blocker() == ("CUDA is already initialised in this kernel, before nbtrain was "
                                        "imported, so it cannot say where (import nbtrain first to find out)")


def test_a_record_from_before_a_fork_is_not_this_process(cuda_state, monkeypatch):
    monkeypatch.setattr(preflight, "_first_init", CudaInit(os.getpid() + 1, "MainThread", ()))
    assert preflight.recorded_cuda_init() is None and preflight.fork_blocker() is None


def test_auto_picks_the_template_and_says_why_in_one_line(cuda_state):
    assert choose(words(), cpu_plan()).start == "fork"
    initialise_cuda_here()
    cuda_state["on"] = True
    choice = choose(words(), cpu_plan())
    assert (choice.strategy, choice.start) == ("ddp", "template") and "\n" not in choice.note
    assert choice.note.startswith("ddp on 2 CPU ranks, gloo (started by template, chosen by start='auto'), not fork: "
                                  f"CUDA is already initialised in this kernel, at test_preflight line {NAMED_LINE} "
                                  "(`[call() for")
    explicit = choose(words("ddp_spawn"), cpu_plan())
    assert (explicit.strategy, explicit.start, explicit.note) == ("ddp", "template", None)


def test_the_refusal_pickles(cuda_state):
    cuda_state["on"] = True
    with pytest.raises(ForkUnsafeError) as refused:
        preflight.check_fork()
    again = pickle.loads(pickle.dumps(refused.value))
    assert str(again) == str(refused.value) and again.reason == refused.value.reason


# --- offender modules ---------------------------------------------------------------------------

def test_an_import_that_initialises_cuda_is_named_with_the_module(cuda_state, fake_module):
    fake_module("bitsandbytes.py", f"""\
        import torch
        VERSION = "0.0-fake"
        {RUN_QUEUED}
    """)
    import bitsandbytes  # noqa: F401

    cuda_state["on"] = True
    assert preflight.imported_offenders() == ("bitsandbytes",)
    reason = preflight.fork_blocker()
    assert reason.startswith("CUDA is already initialised in this kernel, by importing bitsandbytes, "
                             "at bitsandbytes line 3 (`[call() for call, _ in torch.cuda._queued_calls")
    with pytest.raises(ForkUnsafeError) as refused:
        preflight.check_fork()
    assert refused.value.offenders == ("bitsandbytes",)
    assert "Imported, and known to initialise CUDA: bitsandbytes (" in str(refused.value)
    assert "keep CUDA work, and imports such as bitsandbytes, inside the training function" in str(refused.value)


def test_the_package_the_user_imported_is_named_with_the_inner_line(cuda_state, fake_module):
    fake_module("bigmodels/__init__.py", "from . import quant\n")
    fake_module("bigmodels/quant.py", f"""\
        import torch

        def load():
            {RUN_QUEUED}

        load()
    """)
    import bigmodels  # noqa: F401

    reason = preflight.fork_blocker()
    assert "by importing bigmodels, at bigmodels.quant line 4 (`[call() for" in reason
    assert preflight.imported_offenders() == ()


def test_offenders_are_the_evidence_when_nothing_was_recorded(cuda_state, fake_module):
    fake_module("xformers.py", "import torch\n")
    import xformers  # noqa: F401

    cuda_state["on"] = True
    assert preflight.fork_blocker() == ("CUDA is already initialised in this kernel, before nbtrain could "
                                        "see where (imported: xformers)")


def test_a_context_opened_outside_torch_is_found_through_nvml(cuda_state, fake_module):
    me = GpuProcess(os.getpid(), "python")
    inventory = StaticInventory([Gpu(0, "NVIDIA A100-SXM4-40GB", "GPU-a", "00000000:07:00.0", processes=(me,)),
                                 Gpu(1, "NVIDIA A100-SXM4-40GB", "GPU-b", "00000000:0F:00.0")])
    use_inventory(inventory)
    try:
        assert preflight.fork_blocker() is None  # no such library loaded: NVML is not even asked
        fake_module("cupy.py", "import os\n")
        import cupy  # noqa: F401

        reason = preflight.fork_blocker()
        assert reason == (f"this kernel (pid {os.getpid()}) already holds a CUDA context on GPU 0, opened "
                          f"outside torch (imported: cupy)")
    finally:
        use_inventory(None)


# --- describing a recorded stack (pure) ---------------------------------------------------------

STDLIB = os.path.dirname(os.__file__)


def frame(filename, lineno, module, line="", function="<module>"):
    return Frame(filename, lineno, function, module, line)


KERNEL = [frame(f"{STDLIB}/runpy.py", 88, "runpy", "exec(code, run_globals)", "_run_code"),
          frame("/venv/site-packages/ipykernel/kernelapp.py", 700, "ipykernel.kernelapp", "", "start")]
TORCH = [frame("/venv/site-packages/torch/cuda/__init__.py", 500, "torch.cuda", "", "_lazy_init")]
IMPORTING = [frame("<frozen importlib._bootstrap>", 1, "importlib._bootstrap", "", "_find_and_load"),
             frame("<frozen importlib._bootstrap>", 2, "importlib._bootstrap", "", "_call_with_frames_removed")]


def describe(*frames, thread="MainThread"):
    return preflight.describe_cuda_init(CudaInit(1, thread, tuple(frames)))


def test_describe_a_cell_line_outside_ipython():
    cell = frame("/tmp/ipykernel_42/123.py", 2, "__main__", "torch.zeros(1, device='cuda')")
    assert describe(*KERNEL, cell, *TORCH) == ("in cell /tmp/ipykernel_42/123.py line 2 "
                                               "(`torch.zeros(1, device='cuda')`)")


def test_describe_a_library_call_from_a_classic_ipython_cell():
    cell = frame("<ipython-input-7-abcdef>", 3, "__main__", "model.cuda()")
    lib = frame("/venv/site-packages/helper/move.py", 9, "helper.move", "m.to('cuda')", "move")
    assert describe(*KERNEL, cell, lib, *TORCH) == ("in cell In[7] line 3 (`model.cuda()`), "
                                                    "via helper.move line 9 (`m.to('cuda')`)")


def test_describe_nested_imports_names_the_outer_package_and_the_line():
    cell = frame("<ipython-input-3-abcdef>", 1, "__main__", "import transformers")
    outer = frame("/venv/site-packages/transformers/__init__.py", 5, "transformers", "import bitsandbytes")
    inner = frame("/venv/site-packages/bitsandbytes/cextension.py", 12, "bitsandbytes.cextension",
                  "torch.cuda.get_device_capability()", "get_lib")
    text = describe(*KERNEL, cell, *IMPORTING, outer, *IMPORTING,
                    frame(inner.filename, 30, inner.module, "lib = get_lib()"), inner, *TORCH)
    assert text == ("by importing transformers in cell In[3] line 1 (`import transformers`), at "
                    "bitsandbytes.cextension line 12 (`torch.cuda.get_device_capability()`)")


def test_describe_a_script_a_thread_and_a_stack_with_nothing_outside_torch():
    script = frame("/home/me/train.py", 14, "__main__", "torch.cuda.init()")
    assert describe(script, *TORCH, thread="loader") == ("at /home/me/train.py line 14 "
                                                         "(`torch.cuda.init()`) (in thread 'loader')")
    assert describe(*TORCH) == "by code with no Python frame outside torch"


# --- NCCL: peer-to-peer ---------------------------------------------------------------------------

def gpu(i, name):
    return Gpu(i, name, f"GPU-{i}", f"00000000:0{i}:00.0", index=i)


RTX = [gpu(0, "NVIDIA GeForce RTX 4090"), gpu(1, "NVIDIA GeForce RTX 4090")]


@pytest.mark.parametrize("gpus, driver, p2p, expected", [
    (RTX, "535.129.03", None, "NVIDIA GeForce RTX 4090 has no peer-to-peer support, but driver 535.129.03"),
    (RTX, None, None, "but a driver of unknown version offers it"),
    (RTX, "550.40.07", {(0, 1): True}, None),  # this driver reports the truth; NCCL stays off P2P
    (RTX[:1], "535.129.03", None, None),  # one GPU: nothing to talk to
    ([gpu(0, "NVIDIA RTX 4000 Ada Generation"), gpu(1, "NVIDIA RTX 4000 Ada Generation")], "535.1.1", None, None),
    ([gpu(0, "NVIDIA A100-PCIE-40GB"), gpu(1, "NVIDIA A100-PCIE-40GB")], "560.28.03", {(0, 1): False},
     "NVML reports no peer-to-peer access between GPU 0 and GPU 1"),
    ([gpu(0, "NVIDIA A100-PCIE-40GB"), gpu(1, "NVIDIA A100-PCIE-40GB")], "560.28.03", {(0, 1): True}, None),
])
def test_p2p_problem(gpus, driver, p2p, expected):
    problem = preflight.p2p_problem(gpus, driver, p2p)
    assert problem is None if expected is None else expected in problem


def gpu_plan(nodes=1):
    return DevicePlan("gpu", (0, 1), (0, 1), "nccl", nodes)


def test_nccl_environ_sets_only_what_the_user_left_unset():
    inv, old = StaticInventory(RTX), ("535.129.03", {})
    env, note = preflight.nccl_environ(gpu_plan(), inv, {}, old)
    assert env == {"NCCL_P2P_DISABLE": "1", "NCCL_IB_DISABLE": "1"}
    assert note.endswith("ranks get NCCL_P2P_DISABLE=1, NCCL_IB_DISABLE=1 (set them yourself to choose otherwise)")
    assert preflight.nccl_environ(gpu_plan(), inv, {"NCCL_P2P_DISABLE": "0"}, old)[0] == {"NCCL_IB_DISABLE": "1"}
    assert preflight.nccl_environ(gpu_plan(), inv, {"NCCL_P2P_DISABLE": "0", "NCCL_IB_DISABLE": "0"}, old) == ({}, None)
    # Across nodes InfiniBand may be the link between them: leave it alone.
    assert preflight.nccl_environ(gpu_plan(nodes=2), inv, {}, old)[0] == {"NCCL_P2P_DISABLE": "1"}
    assert preflight.nccl_environ(cpu_plan(), inv, {}, old) == ({}, None)
    assert preflight.nccl_environ(gpu_plan(), inv, {}, ("550.54.14", {(0, 1): True})) == ({}, None)


class Notes:
    def __init__(self):
        self.notes = []

    def note(self, text):
        self.notes.append(text)


def test_the_launcher_passes_the_quirk_to_every_rank_and_says_so(monkeypatch):
    # NVML's answers (exercised on a GPU only) stand for an old driver here.
    monkeypatch.setattr(preflight, "_nvml_p2p_facts", lambda gpus: ("535.129.03", {}))
    monkeypatch.delenv("NCCL_P2P_DISABLE", raising=False)
    monkeypatch.delenv("NCCL_IB_DISABLE", raising=False)
    use_inventory(StaticInventory(RTX))
    try:
        job, display = Job(print, (), {}, gpu_plan(), "ddp_spawn"), Notes()
        job = job.with_options(quirk_env=ProcessLauncher()._quirk_env(job, display))
    finally:
        use_inventory(None)
    assert len(display.notes) == 1 and "RTX 4090 has no peer-to-peer support" in display.notes[0]
    for local in (0, 1):
        env = rank_environ(job, local, {})
        assert env["NCCL_P2P_DISABLE"] == env["NCCL_IB_DISABLE"] == "1"
    assert "NCCL_P2P_DISABLE" not in os.environ  # set in the ranks only


# --- fork hygiene in real ranks -------------------------------------------------------------------

def rank_env():
    return {k: os.environ.get(k) for k in ("TOKENIZERS_PARALLELISM", "NCCL_P2P_DISABLE", "NCCL_IB_DISABLE")}


@pytest.mark.slow
@pytest.mark.parametrize("user_value, seen", [(None, "false"), ("true", "true")])
def test_forked_ranks_get_tokenizers_parallelism_false_unless_set(monkeypatch, no_leftovers, user_value, seen):
    if user_value is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", user_value)
    r = nbtrain.launch(rank_env, devices=2, accelerator="cpu", start="fork", progress=False)
    assert r.values == [{"TOKENIZERS_PARALLELISM": seen, "NCCL_P2P_DISABLE": None, "NCCL_IB_DISABLE": None}] * 2
    assert os.environ.get("TOKENIZERS_PARALLELISM") == user_value  # the kernel's own is untouched


# --- in a real Jupyter kernel -------------------------------------------------------------------

def run_counted(kernel, code: str, timeout: float = 180):
    """Execute a cell; (its In[n] number, stdout, error content or None)."""
    out, error = [], None

    def hook(msg):
        nonlocal error
        if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
            out.append(msg["content"]["text"])
        elif msg["msg_type"] == "error":
            error = msg["content"]

    reply = kernel.client.execute_interactive(code, timeout=timeout, output_hook=hook, allow_stdin=False)
    return reply["content"]["execution_count"], "".join(out), error


def ok(kernel, code):
    n, out, error = run_counted(kernel, code)
    assert error is None, error
    return n, out


@pytest.fixture
def nb(kernel):
    ok(kernel, "import os, sys, torch, nbtrain\nfrom nbtrain.common import preflight\n"
               "stands_for_torch = preflight.cuda_is_initialized\n"
               "def work(x):\n    return nbtrain.context().rank * x\n")
    yield kernel
    # Back to a kernel where CUDA was never initialised, for the next test.
    ok(kernel, "preflight.cuda_is_initialized = stands_for_torch\npreflight._first_init = None")


@pytest.mark.slow
def test_in_a_kernel_the_refusal_names_the_cell_and_line(nb):
    define, _ = ok(nb, f"def setup():\n    model = None\n    {RUN_QUEUED}\n    return model\n")
    call, _ = ok(nb, "setup()")
    # CUDA cannot initialise on this machine; stand in for torch's flag, which _lazy_init sets next.
    ok(nb, "preflight.cuda_is_initialized = lambda: True")
    _, _, error = run_counted(nb, "nbtrain.launch(work, 2, devices=2, accelerator='cpu', start='fork', progress=False)")
    assert error is not None and error["ename"] == "ForkUnsafeError"
    cause = (f"CUDA is already initialised in this kernel, in cell In[{define}] line 3 (`{RUN_QUEUED}`), "
             f"called from cell In[{call}] line 1 (`setup()`)")
    assert error["evalue"].startswith(f"start='fork' refused: {cause}; a forked rank cannot")

    _, out = ok(nb, "r = nbtrain.launch(work, 2, devices=2, accelerator='cpu', strategy='auto', progress=False)")
    assert f"nbtrain: ddp on 2 CPU ranks, gloo (started by template, chosen by start='auto'), not fork: {cause}\n" in out
    assert nb.value("r.strategy, r.start, r.values") == ("ddp", "template", [0, 2])

    _, out = ok(nb, "r = nbtrain.launch(work, 3, devices=2, accelerator='cpu', start='template', progress=False)")
    assert out == "" and nb.value("r.values") == [0, 3]


@pytest.mark.slow
def test_in_a_kernel_an_import_that_initialises_cuda_is_named(nb, tmp_path):
    (tmp_path / "bitsandbytes.py").write_text(f"import torch\n\n{RUN_QUEUED}\n")
    ok(nb, f"sys.path.insert(0, {str(tmp_path)!r})")
    n, _ = ok(nb, "import torch\nimport bitsandbytes as bnb\npreflight.cuda_is_initialized = lambda: True")
    _, _, error = run_counted(nb, "nbtrain.launch(work, 2, devices=2, accelerator='cpu', start='fork', progress=False)")
    assert error is not None and error["ename"] == "ForkUnsafeError"
    assert (f"CUDA is already initialised in this kernel, by importing bitsandbytes in cell In[{n}] line 2 "
            f"(`import bitsandbytes as bnb`), at bitsandbytes line 3 (`[call() for") in error["evalue"]
    assert "\nImported, and known to initialise CUDA: bitsandbytes (" in error["evalue"]
    ok(nb, f"sys.path.remove({str(tmp_path)!r}); del sys.modules['bitsandbytes']")


# --- on a real GPU --------------------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: CUDA cannot initialise on this machine")
def test_real_cuda_initialisation_is_named(tmp_path):
    (tmp_path / "gpulib.py").write_text("import torch\nCAPABILITY = torch.cuda.get_device_capability()\n")
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""\
        import torch, nbtrain
        from nbtrain.common import preflight

        def work():
            return nbtrain.context().rank

        assert preflight.fork_blocker() is None
        torch.cuda.init()
        assert torch.cuda.is_initialized()
        try:
            nbtrain.launch(work, devices=2, accelerator="cpu", start="fork", progress=False)
        except nbtrain.ForkUnsafeError as exc:
            print("REFUSED", exc)
        r = nbtrain.launch(work, devices=2, accelerator="cpu", progress=False)
        print("AUTO", r.strategy, r.start, r.values)
        driver, pairs = preflight._nvml_p2p_facts(nbtrain.gpus())
        print("NVML", driver, pairs)
    """))
    run = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert f"REFUSED start='fork' refused: CUDA is already initialised in this kernel, at {script} line 8 " \
           "(`torch.cuda.init()`); a forked rank cannot initialise CUDA again" in out
    assert "AUTO ddp template [0, 1]" in out and f"not fork: CUDA is already initialised in this kernel, at {script} line 8" in out
    assert "NVML None" not in out, out

    imported = tmp_path / "imports.py"
    imported.write_text("import torch, nbtrain\nimport gpulib\nprint(nbtrain.common.preflight.fork_blocker())\n")
    run = subprocess.run([sys.executable, str(imported)], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path, env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.startswith("CUDA is already initialised in this kernel, by importing gpulib, at gpulib line 2 "
                                 "(`CAPABILITY = torch.cuda.get_device_capability()`)"), run.stdout


@pytest.mark.slow
@pytest.mark.parametrize("order", ["import nbtrain, torch", "import torch, nbtrain"])
def test_the_hook_is_placed_whichever_is_imported_first(order):
    # `import nbtrain` no longer imports torch: the hook waits for torch.cuda to load.
    code = (f"{order}\n"
            "print(sum(getattr(c, 'nbtrain_recorder', False) for c, _ in torch.cuda._queued_calls))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.stdout.strip() == "1", run.stdout + run.stderr
