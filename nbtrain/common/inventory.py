"""What GPUs exist, which of them this process may see, and who is using them.

Read through NVML (`nvidia-ml-py`), never through torch: asking torch creates a CUDA
context in the kernel, after which forking ranks is impossible. The source is injectable
(`StaticInventory`, `use_inventory`) so selection logic and displays are exercised without a GPU.
Showing GPUs is the display layer's job (`display/gpus.py`, `nbtrain.gpus()`): nothing here renders.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Protocol

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    name: str
    memory: int | None = None  # bytes; NVML cannot always tell


@dataclass(frozen=True)
class Gpu:
    physical_index: int  # NVML's index (PCI bus order)
    name: str
    uuid: str
    pci_bus_id: str = ""
    memory_used: int = 0  # bytes
    memory_total: int = 0  # bytes
    utilization: int | None = None  # percent
    processes: tuple[GpuProcess, ...] = ()
    compute_capability: tuple[int, int] | None = None
    index: int = -1  # position among the GPUs this process sees; set by visible_gpus()

    @property
    def is_free(self) -> bool:
        return not self.processes


class Inventory(Protocol):
    def physical_gpus(self) -> list[Gpu]:
        """Every GPU on the machine, visibility not applied."""


@dataclass
class StaticInventory:
    """A fixed list of GPUs: for tests, demos and documentation on machines without one."""

    gpus: list[Gpu] = field(default_factory=list)

    def physical_gpus(self) -> list[Gpu]:
        return list(self.gpus)


class NvmlInventory:
    """The machine's GPUs through NVML; an empty list when there is no driver or library."""

    def __init__(self):
        self._lock = threading.Lock()
        self._ready: bool | None = None

    def _init(self) -> bool:
        with self._lock:
            if self._ready is None:
                try:
                    import pynvml

                    pynvml.nvmlInit()
                    self._ready = True
                except Exception as exc:  # no driver, no library, no permission: no GPUs
                    log.debug("NVML unavailable: %s", exc)
                    self._ready = False
            return self._ready

    def physical_gpus(self) -> list[Gpu]:
        if not self._init():
            return []
        import pynvml

        try:
            count = pynvml.nvmlDeviceGetCount()
            return [_read_gpu(pynvml, i) for i in range(count)]
        except pynvml.NVMLError as exc:
            log.debug("NVML query failed: %s", exc)
            return []


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _optional(call, *args):
    try:
        return call(*args)
    except Exception:  # a field this GPU or driver does not support
        return None


def _process_name(pynvml, pid: int) -> str:
    name = _optional(pynvml.nvmlSystemGetProcessName, pid)
    if name:
        return os.path.basename(_text(name))
    import psutil  # here: `import nbtrain` reads this module and stays light

    try:
        return psutil.Process(pid).name()
    except psutil.Error:
        return "?"  # a process in another container


def _read_gpu(pynvml, i: int) -> Gpu:
    handle = pynvml.nvmlDeviceGetHandleByIndex(i)
    memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
    utilization = _optional(pynvml.nvmlDeviceGetUtilizationRates, handle)
    pci = _optional(pynvml.nvmlDeviceGetPciInfo, handle)
    procs = _optional(pynvml.nvmlDeviceGetComputeRunningProcesses, handle) or []
    capability = _optional(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    return Gpu(
        physical_index=i,
        name=_text(pynvml.nvmlDeviceGetName(handle)),
        uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
        pci_bus_id=_text(pci.busId) if pci is not None else "",
        memory_used=int(memory.used),
        memory_total=int(memory.total),
        utilization=None if utilization is None else int(utilization.gpu),
        processes=tuple(
            GpuProcess(p.pid, _process_name(pynvml, p.pid), getattr(p, "usedGpuMemory", None))
            for p in procs
        ),
        compute_capability=tuple(capability) if capability else None,
    )


_default: Inventory = NvmlInventory()


def use_inventory(inventory: Inventory | None) -> None:
    """Make `inventory` the source for every later query (None restores NVML)."""
    global _default
    _default = inventory if inventory is not None else NvmlInventory()


def _ordered(gpus: list[Gpu], order: str) -> list[Gpu]:
    if order == "PCI_BUS_ID":
        return sorted(gpus, key=lambda g: (g.pci_bus_id.lower(), g.physical_index))
    # FASTEST_FIRST, CUDA's own default: its exact ranking is not published; newest
    # architecture first, then the larger card, is the documented approximation.
    return sorted(
        gpus,
        key=lambda g: (tuple(-c for c in (g.compute_capability or (0, 0))), -g.memory_total, g.pci_bus_id),
    )


def _apply_visibility(ordered: list[Gpu], spec: str) -> list[Gpu]:
    # CUDA's rule: entries are indices into the ordered list or UUID prefixes; the list
    # ends at the first entry that is invalid or repeated.
    chosen: list[Gpu] = []
    for entry in (e.strip() for e in spec.split(",")):
        gpu = None
        if entry.lstrip("-").isdigit():
            i = int(entry)
            gpu = ordered[i] if 0 <= i < len(ordered) else None
        elif entry.startswith(("GPU-", "MIG-")):
            matches = [g for g in ordered if g.uuid.startswith(entry)]
            gpu = matches[0] if len(matches) == 1 else None
        if gpu is None or gpu in chosen:
            break
        chosen.append(gpu)
    return chosen


def visible_gpus(inventory: Inventory | None = None, environ: Mapping[str, str] | None = None) -> list[Gpu]:
    """The GPUs this process sees, in CUDA's order, each with its visible `index`."""
    environ = os.environ if environ is None else environ
    physical = (inventory or _default).physical_gpus()
    ordered = _ordered(physical, environ.get("CUDA_DEVICE_ORDER", "FASTEST_FIRST"))
    spec = environ.get("CUDA_VISIBLE_DEVICES")
    visible = ordered if spec is None else _apply_visibility(ordered, spec)
    return [replace(g, index=i) for i, g in enumerate(visible)]


def describe_holders(gpu: Gpu) -> str:
    return ", ".join(
        f"pid {p.pid} ({p.name}{', ' + _gib(p.memory) if p.memory else ''})" for p in gpu.processes
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"


def find_free_gpus(k: int | None = None, inventory: Inventory | None = None,
                   environ: Mapping[str, str] | None = None) -> list[int]:
    """Visible indices of `k` GPUs with no compute process on them (all free ones if k is None)."""
    if k is not None and (type(k) is not int or k < 1):
        raise ValueError(f"find_free_gpus(k={k!r}): k must be a positive int, or None for every free GPU.")
    visible = visible_gpus(inventory, environ)
    free = [g.index for g in visible if g.is_free]
    wanted = len(free) if k is None else k
    if wanted == 0 or len(free) < wanted:
        busy = "; ".join(f"GPU {g.index} held by {describe_holders(g)}" for g in visible if not g.is_free)
        asked = "a free GPU" if k is None else f"{k} free GPU{'s' if k != 1 else ''}"
        found = f"{len(free)} of {len(visible)} visible {'is' if len(free) == 1 else 'are'} free"
        raise RuntimeError(f"asked for {asked}, but {found}" + (f". Busy: {busy}." if busy else "."))
    return free[:wanted]
