"""Checks made in the kernel before any rank starts; each error says what to do.

Fork safety. A process that initialised CUDA cannot fork ranks that use it: the ranks die
with "Cannot re-initialize CUDA in forked subprocess". The question is asked in the kernel,
before forking (`torch.cuda.is_initialized()`; `_is_in_bad_fork()` is always False in the
parent). To say *what* initialised it, `install_cuda_init_hook()` (run at `import nbtrain`)
queues a recorder with `torch.cuda._lazy_call`: torch runs queued calls inside
`torch.cuda._lazy_init()` at the moment CUDA initialises, in the thread that triggered it,
so the recorder's stack shows the cell line or the import that did it.

NCCL quirks. Consumer Ada cards (GeForce RTX 40x0) have no peer-to-peer support, yet drivers
before 550.40.07 offer it and NCCL hangs on it; such ranks get NCCL_P2P_DISABLE/NCCL_IB_DISABLE.
"""
from __future__ import annotations

import itertools
import linecache
import logging
import os
import re
import sys
import sysconfig
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from .errors import NbtrainError
from .import_hooks import when_imported
from .inventory import visible_gpus

log = logging.getLogger(__name__)

FORK_FIX = (
    "What to do: restart the kernel and keep CUDA work{imports} inside the training function, or use "
    "start='template', 'spawn' or 'torchrun' (fresh processes; start='auto' picks the template by itself)."
)
CUDA_FORK_ERROR = ("a forked rank cannot initialise CUDA again "
                   "(it would fail with 'Cannot re-initialize CUDA in forked subprocess')")

# Modules whose presence in sys.modules is evidence that CUDA may be initialised, with why.
# Those that initialise CUDA through torch also show up in the recorded stack; those that
# talk to the driver themselves (OUTSIDE_TORCH) never pass through torch's hook, so for them
# this list is the only evidence nbtrain has.
KNOWN_OFFENDERS = {
    "bitsandbytes": "queries the GPU when imported, to pick its CUDA library",
    "torchao": "some versions query the GPU when imported",
    "fastai": "selects a CUDA device when imported (Kaggle, Colab)",
    "xformers": "queries the GPU when imported, to pick its kernels",
    "apex": "some extensions query the GPU when imported",
    "deepspeed": "queries the accelerator when imported",
    "vllm": "queries the GPU when imported",
    "flash_attn": "loads CUDA kernels when imported",
    "cupy": "opens its own CUDA context on first use",
    "pycuda.autoinit": "opens a CUDA context when imported",
    "numba.cuda": "initialises the CUDA driver on first use",
    "jax": "opens CUDA contexts on every GPU on first use",
    "tensorflow": "opens CUDA contexts on every GPU on first use",
}
OUTSIDE_TORCH = ("cupy", "pycuda.autoinit", "numba.cuda", "jax", "tensorflow")


class ForkUnsafeError(NbtrainError, RuntimeError):
    """Forking ranks from this kernel would fail inside the ranks; refused up front.

    `.reason` is the one-line cause, `.offenders` the imported modules known to initialise CUDA.
    """

    def __init__(self, message: str, reason: str = "", offenders: tuple[str, ...] = ()):
        super().__init__(message)
        self.reason, self.offenders = reason, tuple(offenders)

    def __reduce__(self):
        return type(self), (str(self), self.reason, self.offenders)

    @classmethod
    def refusing(cls, reason: str, offenders: tuple[str, ...] = (), cuda: bool = True) -> ForkUnsafeError:
        lines = [f"start='fork' refused: {reason}" + (f"; {CUDA_FORK_ERROR}." if cuda else ".")]
        if offenders:
            named = "; ".join(f"{m} ({KNOWN_OFFENDERS[m]})" for m in offenders)
            lines.append(f"Imported, and known to initialise CUDA: {named}.")
        imports = ", and imports such as " + ", ".join(offenders) + "," if offenders else ""
        lines.append(FORK_FIX.format(imports=imports))
        return cls("\n".join(lines), reason, offenders)


# --- where CUDA was initialised -------------------------------------------------------------

@dataclass(frozen=True)
class Frame:
    filename: str
    lineno: int
    function: str
    module: str  # the frame's __name__, "" when unknown
    line: str  # the stripped source line, "" when unavailable


@dataclass(frozen=True)
class CudaInit:
    """The first CUDA initialisation in process `pid`; `frames` outermost first."""

    pid: int
    thread: str
    frames: tuple[Frame, ...]
    seen: bool = True  # False: CUDA was already initialised when the hook was installed


_first_init: CudaInit | None = None


def cuda_is_initialized() -> bool:
    """torch's own answer, asked in this process (the kernel), before any fork.

    A seam, honestly: on a CPU-only machine CUDA can never initialise, so tests replace this
    function to stand for an initialised CUDA. Nothing else should.
    """
    cuda = sys.modules.get("torch.cuda")
    return cuda is not None and cuda.is_initialized()


def _frames_from(frame) -> tuple[Frame, ...]:
    frames = []
    while frame is not None:
        code, glob = frame.f_code, frame.f_globals
        line = linecache.getline(code.co_filename, frame.f_lineno, glob).strip()
        frames.append(Frame(code.co_filename, frame.f_lineno, code.co_name, str(glob.get("__name__", "")), line))
        frame = frame.f_back
    return tuple(reversed(frames))


def _record_cuda_init() -> None:
    """Queued with torch.cuda._lazy_call; torch calls it inside _lazy_init as CUDA initialises."""
    global _first_init
    try:
        if _first_init is None or _first_init.pid != os.getpid():  # a forked child starts afresh
            _first_init = CudaInit(os.getpid(), threading.current_thread().name, _frames_from(sys._getframe(1)))
    except Exception as exc:  # a diagnostic must never break CUDA (torch would raise DeferredCudaCallError)
        log.debug("could not record where CUDA was initialised: %s", exc)


_record_cuda_init.nbtrain_recorder = True  # type: ignore[attr-defined]  # how a second install (or a reloaded module) recognises it


def install_cuda_init_hook() -> bool:
    """Have torch tell nbtrain where CUDA is first initialised in this process.

    Run at `import nbtrain` and again, harmlessly, by `%load_ext nbtrain`: a second call finds
    the recorder already queued. False when the hook cannot be placed (CUDA already initialised,
    or a torch without `_lazy_call`); the fork check then still refuses, without naming the line.
    """
    global _first_init
    cuda = sys.modules.get("torch.cuda")
    queued = getattr(cuda, "_queued_calls", None)
    if cuda is None or queued is None or not hasattr(cuda, "_lazy_call"):
        return False
    if any(getattr(entry[0], "nbtrain_recorder", False) for entry in queued):
        return True
    if cuda.is_initialized():  # _lazy_call would run the recorder now and record this import
        if _first_init is None:
            _first_init = CudaInit(os.getpid(), threading.current_thread().name, (), seen=False)
        return False
    cuda._lazy_call(_record_cuda_init)
    return True


def install_cuda_init_hook_when_imported() -> None:
    """`install_cuda_init_hook` now if torch.cuda is loaded, else as soon as it is: `import nbtrain`
    does not import torch (the notebook's own `import torch` may come after it)."""
    when_imported("torch.cuda", _install_after_import)


def _install_after_import(_cuda) -> None:
    install_cuda_init_hook()


def recorded_cuda_init() -> CudaInit | None:
    """This process's first CUDA initialisation, when the hook saw it (not one inherited by fork)."""
    record = _first_init
    return record if record is not None and record.pid == os.getpid() else None


_CELL_FILE = re.compile(r"ipykernel_\d+[/\\]\w+\.py$|^<ipython-input-\d+-")
_IMPORTLIB = ("importlib._bootstrap", "importlib._bootstrap_external", "_frozen_importlib",
              "_frozen_importlib_external")
_STDLIB = tuple({os.path.normpath(sysconfig.get_paths()[k]) + os.sep for k in ("stdlib", "platstdlib")})


def _cell_label(filename: str) -> str | None:
    """'In[4]' for a notebook cell's code, from IPython's own map of cell filenames."""
    ipython = sys.modules.get("IPython")  # never imported here: only a running shell has cells
    shell = getattr(ipython, "get_ipython", lambda: None)()
    try:
        named = shell.compile.format_code_name(filename)  # type: ignore[union-attr]  # no shell: the except
        # gives ("Cell", "In[4]") on IPython 8+
    except Exception:
        named = None
    if named:
        return named[1]
    number = re.match(r"<ipython-input-(\d+)-", filename)
    return f"In[{number.group(1)}]" if number else None


def _is_cell(frame: Frame) -> bool:
    return bool(_CELL_FILE.search(frame.filename)) or _cell_label(frame.filename) is not None


def _in_package(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def _is_foreign(frame: Frame) -> bool:
    """Code that is neither torch's, nbtrain's nor the standard library's: where to look."""
    if _in_package(frame.module, "torch") or _in_package(frame.module, "nbtrain"):
        return False
    name = frame.filename
    if name.startswith("<frozen "):
        return False
    in_stdlib = name.startswith(_STDLIB) and "-packages" not in name
    return not in_stdlib


def _is_import(frames: tuple[Frame, ...], i: int) -> bool:
    """A module's top level, run by the import machinery."""
    return frames[i].function == "<module>" and i > 0 and frames[i - 1].module in _IMPORTLIB


def _where(frame: Frame) -> str:
    if _is_cell(frame):
        place = f"cell {_cell_label(frame.filename) or frame.filename} line {frame.lineno}"
    elif frame.module and frame.module != "__main__":
        place = f"{frame.module} line {frame.lineno}"
    else:
        place = f"{frame.filename} line {frame.lineno}"
    line = frame.line if len(frame.line) <= 100 else frame.line[:97] + "..."
    return f"{place} (`{line}`)" if line else place


def describe_cuda_init(record: CudaInit) -> str:
    """A phrase naming what initialised CUDA: 'in cell In[4] line 2 (`...`)', 'by importing X ...'."""
    frames = record.frames
    foreign = [i for i, f in enumerate(frames) if _is_foreign(f)]
    if not foreign:
        return "by code with no Python frame outside torch"
    site = foreign[-1]
    cells = [i for i in foreign if _is_cell(frames[i])]
    inner_cell = cells[-1] if cells else None
    # Imports that the user's cell statement started (in a script: any import on the way).
    imports = [i for i in foreign if _is_import(frames, i) and (inner_cell is None or i > inner_cell)]
    if imports:
        package = frames[imports[0]].module.split(".")[0]
        text = f"by importing {package}"
        if inner_cell is not None:
            text += f" in {_where(frames[inner_cell])}"
        text += f", at {_where(frames[site])}"
    elif inner_cell is not None:
        text = f"in {_where(frames[inner_cell])}"
        if site != inner_cell:
            text += f", via {_where(frames[site])}"
    else:
        text = f"at {_where(frames[site])}"
    if cells and cells[0] != inner_cell:
        text += f", called from {_where(frames[cells[0]])}"
    if record.thread not in ("MainThread", ""):
        text += f" (in thread {record.thread!r})"
    return text


def imported_offenders(modules: Mapping[str, object] | None = None) -> tuple[str, ...]:
    """Modules from KNOWN_OFFENDERS that are already imported."""
    modules = sys.modules if modules is None else modules
    return tuple(name for name in KNOWN_OFFENDERS if modules.get(name) is not None)


# --- the fork check ---------------------------------------------------------------------------

def _cuda_reason(offenders: tuple[str, ...]) -> str:
    record = recorded_cuda_init()
    if record is not None and record.seen:
        origin = describe_cuda_init(record)
    elif offenders:
        origin = f"before nbtrain could see where (imported: {', '.join(offenders)})"
    else:
        origin = "before nbtrain was imported, so it cannot say where (import nbtrain first to find out)"
    return f"CUDA is already initialised in this kernel, {origin}"


def own_cuda_contexts(gpus, pid: int) -> list:
    """The GPUs on which process `pid` holds a CUDA context, as NVML lists them."""
    return [g for g in gpus if any(p.pid == pid for p in g.processes)]


def _outside_torch_reason(offenders: tuple[str, ...]) -> str | None:
    # Only asked when a library that bypasses torch is loaded, so NVML is not queried
    # on every launch. NVML lists host PIDs: inside a container this finds nothing.
    outside = [m for m in offenders if m in OUTSIDE_TORCH]
    if not outside:
        return None

    held = own_cuda_contexts(visible_gpus(), os.getpid())
    if not held:
        return None
    where = ", ".join(f"GPU {g.index}" for g in held)
    return (f"this kernel (pid {os.getpid()}) already holds a CUDA context on {where}, opened outside torch "
            f"(imported: {', '.join(outside)})")


def _fork_reason(offenders: tuple[str, ...]) -> str | None:
    if sys.platform == "win32":
        return "fork is not available on Windows"
    if cuda_is_initialized() or recorded_cuda_init() is not None:
        # A record alone also counts: the recorder runs only after torch initialised the driver.
        return _cuda_reason(offenders)
    return _outside_torch_reason(offenders)


def fork_blocker() -> str | None:
    """Why forking ranks from this process is unsafe (one line naming the cause), or None."""
    return _fork_reason(imported_offenders())


def check_fork() -> None:
    """Refuse start='fork' with a `ForkUnsafeError` saying what initialised CUDA and what to do."""
    offenders = imported_offenders()
    reason = _fork_reason(offenders)
    if reason:
        about_cuda = sys.platform != "win32"
        raise ForkUnsafeError.refusing(reason, offenders if about_cuda else (), about_cuda)


# --- NCCL quirks --------------------------------------------------------------------------------

NO_P2P_CARDS = re.compile(r"GeForce RTX 40\d0")  # Ada consumer cards: no P2P in hardware
P2P_HONEST_DRIVER = (550, 40, 7)  # from here on the driver reports their P2P as absent


def _version(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(p) for p in text.split("."))
    except (AttributeError, ValueError):
        return None


def p2p_problem(gpus, driver_version: str | None = None,
                p2p: Mapping[tuple[int, int], bool] | None = None) -> str | None:
    """Why NCCL must not use peer-to-peer between `gpus` (inventory `Gpu`s), or None.

    Pure, so it is tested without a GPU: `p2p` maps pairs of physical (NVML) indices to
    whether NVML reports P2P reads as supported; `driver_version` is NVML's, e.g. '535.129.03'.
    """
    if len(gpus) < 2:
        return None
    shown = {g.physical_index: (g.index if g.index >= 0 else g.physical_index) for g in gpus}
    for (a, b), ok in sorted((p2p or {}).items()):
        if not ok and a in shown and b in shown:
            return f"NVML reports no peer-to-peer access between GPU {shown[a]} and GPU {shown[b]}"
    cards = [g for g in gpus if NO_P2P_CARDS.search(g.name)]
    version = _version(driver_version)
    if cards and (version is None or version < P2P_HONEST_DRIVER):
        driver = f"driver {driver_version}" if driver_version else "a driver of unknown version"
        return (f"{cards[0].name} has no peer-to-peer support, but {driver} offers it and NCCL can hang "
                f"(fixed in 550.40.07)")
    return None


def _nvml_p2p_facts(gpus) -> tuple[str | None, dict[tuple[int, int], bool]]:
    """NVML's driver version and pairwise P2P read status; (None, {}) without NVML."""
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as exc:
        log.debug("NVML unavailable for the P2P check: %s", exc)
        return None, {}
    try:
        driver = pynvml.nvmlSystemGetDriverVersion()
        driver = driver.decode() if isinstance(driver, bytes) else str(driver)
        handles = {g.physical_index: pynvml.nvmlDeviceGetHandleByIndex(g.physical_index) for g in gpus}
        p2p = {}
        for a, b in itertools.combinations(sorted(handles), 2):
            status = pynvml.nvmlDeviceGetP2PStatus(handles[a], handles[b], pynvml.NVML_P2P_CAPS_INDEX_READ)
            p2p[(a, b)] = status == pynvml.NVML_P2P_STATUS_OK
        return driver, p2p
    except Exception as exc:  # an old driver without the query: fall back to the card names
        log.debug("NVML P2P query failed: %s", exc)
        return None, {}
    finally:
        pynvml.nvmlShutdown()  # NVML counts inits; this undoes only ours


def nccl_environ(plan, inventory=None, environ: Mapping[str, str] | None = None,
                 facts: tuple[str | None, Mapping[tuple[int, int], bool]] | None = None
                 ) -> tuple[dict[str, str], str | None]:
    """(variables the ranks need, a note saying so) for NCCL on this machine's GPUs.

    Only variables the user has not set; NCCL_IB_DISABLE only on a single node, where
    InfiniBand carries nothing. `facts` = (driver version, P2P map) replaces the NVML query.
    """
    if plan.backend != "nccl" or plan.nprocs < 2:
        return {}, None

    environ = os.environ if environ is None else environ
    gpus = [g for g in visible_gpus(inventory, environ) if g.physical_index in plan.physical]
    driver, p2p = facts if facts is not None else _nvml_p2p_facts(gpus)
    problem = p2p_problem(gpus, driver, p2p)
    if problem is None:
        return {}, None
    wanted = ("NCCL_P2P_DISABLE", "NCCL_IB_DISABLE") if plan.num_nodes == 1 else ("NCCL_P2P_DISABLE",)
    env = {name: "1" for name in wanted if name not in environ}
    if not env:
        return {}, None
    return env, f"{problem}: ranks get {', '.join(f'{k}=1' for k in env)} (set them yourself to choose otherwise)"
