"""Which devices the user means: Lightning's `devices` grammar, GPU visibility, backend choice.

Everything here is pure: it reads an inventory and an environment mapping and returns a
`DevicePlan`, so the same rules are tested on a machine without a GPU.
"""
from __future__ import annotations

import functools
import inspect
import os
from collections.abc import Mapping, MutableMapping, Sequence
from dataclasses import dataclass

from . import inventory as _inventory

ACCEPTED = (
    "Accepted: an int N > 0 (the first N devices), -1 or '-1' (all visible), a list or tuple "
    "of distinct visible indices such as [1, 3], a string such as '3' or '1, 3', 'auto', "
    "or 'free:N' (N GPUs that no other process uses)."
)
ACCELERATORS = ("auto", "gpu", "cpu")
BACKENDS = ("nccl", "gloo", "mpi", "ucc")
# CPU ranks are whole processes (torch imported, a few hundred MB, a dozen fds and threads each):
# past a few per core they only slow each other down, and a typo such as devices=10**6 would
# exhaust the kernel's file descriptors and memory before anything could fail cleanly.
CPU_RANKS_PER_CORE = 4
CPU_RANKS_FLOOR = 16  # small machines can still try world sizes a real cluster would use
MAX_CPU_RANKS_VAR = "NBTRAIN_MAX_CPU_RANKS"


@dataclass(frozen=True)
class DevicePlan:
    """What one launch runs on, per node. Launchers consume this and nothing else."""

    accelerator: str  # "gpu" or "cpu"
    indices: tuple[int, ...]  # device positions as the kernel sees them (CPU: rank numbers)
    physical: tuple[int, ...]  # NVML index behind each GPU index; () on CPU
    backend: str
    num_nodes: int = 1

    @property
    def nprocs(self) -> int:
        return len(self.indices)

    @property
    def world_size(self) -> int:
        return self.nprocs * self.num_nodes

    @property
    def cuda_visible_devices(self) -> str:
        # Ranks get PCI_BUS_ID order with NVML indices, so this is unambiguous whatever
        # order the kernel itself was started with.
        return ",".join(str(p) for p in self.physical)

    def describe(self) -> str:
        kind = "GPU" if self.accelerator == "gpu" else "CPU"
        where = f" {list(self.indices)}" if self.accelerator == "gpu" else ""
        nodes = f" x {self.num_nodes} nodes" if self.num_nodes > 1 else ""
        plural = "s" if self.nprocs != 1 else ""
        return f"{self.nprocs} {kind} rank{plural}{where}{nodes}, {self.backend}"


class _Refusal(Exception):
    """Raised inside the parsers; turned into a message that quotes the user's own input."""

    def __init__(self, what: str, exc: type = ValueError):
        self.what, self.exc = what, exc


def _refusing(parse):
    """Turn a parser's `_Refusal` into an error quoting the caller's `devices`.

    The wrapper takes whatever the parser takes (positional or keyword: `available=4`) and
    shows the parser's own signature to `help()` and `inspect.signature`.
    """
    signature = inspect.signature(parse)

    @functools.wraps(parse)
    def wrapper(*args, **kwargs):
        try:
            return parse(*args, **kwargs)
        except _Refusal as r:
            devices = signature.bind(*args, **kwargs).arguments["devices"]
            raise r.exc(f"devices={devices!r}: {r.what}. {ACCEPTED}") from None

    return wrapper


def _parse_string(text: str) -> int | list[int]:
    text = text.strip()
    if "," in text:
        try:
            return [int(p) for p in (p.strip() for p in text.split(",")) if p]
        except ValueError:
            raise _Refusal("not a comma-separated list of integers") from None
    try:
        return int(text)
    except ValueError:
        raise _Refusal("not an integer, a list of integers or 'auto'") from None


@_refusing
def parse_devices(devices, available: int) -> list[int]:
    """Lightning's GPU `devices` grammar -> list of visible device indices, order kept.

    `available` is the number of visible GPUs.
    """
    if isinstance(devices, str):
        devices = _parse_string(devices)
    if type(devices) is int:
        if devices == -1:
            if available == 0:
                raise _Refusal("no GPU is visible")
            return list(range(available))
        if devices <= 0:
            raise _Refusal("a count must be positive (or -1 for all)")
        if devices > available:
            raise _Refusal(f"asked for {devices} GPUs but {_visible(available)}")
        return list(range(devices))
    if isinstance(devices, (list, tuple)):
        return _check_index_list(devices, available)
    raise _Refusal(f"a {type(devices).__name__} is not a device selection", TypeError)


def _visible(available: int) -> str:
    if available == 0:
        return "no GPU is visible"
    return f"{available} {'is' if available == 1 else 'are'} visible (0-{available - 1})"


def _check_index_list(devices: Sequence, available: int) -> list[int]:
    if not devices:
        raise _Refusal("the list is empty")
    for item in devices:
        if type(item) is not int:
            raise _Refusal(f"{item!r} is not an integer index", TypeError)
    indices = list(devices)
    duplicated = sorted({i for i in indices if indices.count(i) > 1})
    if duplicated:
        raise _Refusal(f"index {duplicated[0]} appears more than once")
    missing = [i for i in indices if not 0 <= i < available]
    if missing:
        raise _Refusal(f"GPU {missing[0]} is not visible ({_visible(available)})")
    return indices


@_refusing
def parse_cpu_devices(devices, cores: int) -> int:
    """Number of CPU ranks: N, -1 (one per core) or 'auto' (one)."""
    if isinstance(devices, str):
        text = devices.strip()
        if text == "auto":
            return 1
        if text.startswith("free"):
            raise _Refusal("'free:N' selects GPUs, and accelerator is 'cpu'")
        try:
            devices = int(text)
        except ValueError:
            raise _Refusal("on CPU, give a number of ranks") from None
    if type(devices) is not int:
        raise _Refusal("on CPU, give a number of ranks as an int", TypeError)
    if devices == -1:
        return cores
    if devices <= 0:
        raise _Refusal("a count must be positive (or -1 for one rank per core)")
    return devices


def ensure_pci_bus_order(environ: MutableMapping[str, str] = os.environ) -> None:
    """NVML numbers GPUs by PCI bus; make CUDA agree unless the user chose otherwise."""
    environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")


def _devices_from_picker(devices):
    # A GPU picker widget (or anything with a `.devices` selection) stands for its selection.
    selection = getattr(devices, "devices", None)
    return devices if selection is None or isinstance(devices, (str, int, list, tuple)) else selection


def plan_devices(
    devices="auto",
    accelerator: str = "auto",
    backend: str | None = None,
    num_nodes: int = 1,
    inventory: _inventory.Inventory | None = None,
    environ: Mapping[str, str] | None = None,
) -> DevicePlan:
    """Resolve the user's `devices`/`accelerator`/`backend` into a `DevicePlan`."""
    environ = os.environ if environ is None else environ
    devices = _devices_from_picker(devices)
    accelerator = _check_accelerator(accelerator)
    if type(num_nodes) is not int or num_nodes < 1:
        raise ValueError(f"num_nodes={num_nodes!r}: must be an int >= 1.")
    visible = _inventory.visible_gpus(inventory, environ) if accelerator != "cpu" else []
    if accelerator == "auto":
        accelerator = "gpu" if visible else "cpu"
    if accelerator == "gpu":
        indices = _gpu_indices(devices, visible, inventory, environ)
        physical = tuple(visible[i].physical_index for i in indices)
        plan = DevicePlan("gpu", tuple(indices), physical, "nccl", num_nodes)
    else:
        n = parse_cpu_devices(devices, os.cpu_count() or 1)
        _check_cpu_rank_count(devices, n, os.cpu_count() or 1, environ)
        plan = DevicePlan("cpu", tuple(range(n)), (), "gloo", num_nodes)
    return _with_backend(plan, backend)


def cpu_rank_limit(cores: int, environ: Mapping[str, str] = os.environ) -> int:
    """How many CPU ranks one node may start: NBTRAIN_MAX_CPU_RANKS, else
    max(CPU_RANKS_FLOOR, CPU_RANKS_PER_CORE x cores)."""
    given = environ.get(MAX_CPU_RANKS_VAR, "").strip()
    if not given:
        return max(CPU_RANKS_FLOOR, CPU_RANKS_PER_CORE * cores)
    try:
        limit = int(given)
    except ValueError:
        limit = 0
    if limit < 1:
        raise ValueError(f"{MAX_CPU_RANKS_VAR}={given!r}: give a positive int, "
                         "the most CPU ranks one launch may start.")
    return limit


def _check_cpu_rank_count(devices, n: int, cores: int, environ: Mapping[str, str]) -> None:
    limit = cpu_rank_limit(cores, environ)
    if n > limit:
        raise ValueError(
            f"devices={devices!r}: {n} CPU ranks is more than this machine can run ({cores} cores; the limit is "
            f"{limit}, {CPU_RANKS_PER_CORE} per core and at least {CPU_RANKS_FLOOR}). Each CPU rank is a whole "
            f"process. To oversubscribe on purpose, set {MAX_CPU_RANKS_VAR}={n} in the environment.")


def _check_accelerator(accelerator) -> str:
    name = accelerator.lower() if isinstance(accelerator, str) else accelerator
    name = "gpu" if name == "cuda" else name
    if name not in ACCELERATORS:
        raise ValueError(f"accelerator={accelerator!r} is not known. Accepted: 'gpu' (or 'cuda'), 'cpu', 'auto'.")
    return name


def _gpu_indices(devices, visible, inventory, environ) -> list[int]:
    if not visible:
        cvd = environ.get("CUDA_VISIBLE_DEVICES")
        why = f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else ""
        raise RuntimeError(
            f"accelerator='gpu' but no GPU is visible{why}. Use accelerator='cpu' or 'auto', "
            "or check the driver with `nvidia-smi`."
        )
    if isinstance(devices, str) and devices.strip() == "auto":
        return list(range(len(visible)))
    if isinstance(devices, str) and devices.strip().startswith("free"):
        return _inventory.find_free_gpus(_free_count(devices, len(visible)), inventory, environ)
    return parse_devices(devices, len(visible))


def _free_count(devices: str, available: int) -> int | None:
    _, _, count = devices.strip().partition(":")
    if not count.strip():
        return None
    try:
        n = int(count)
    except ValueError:
        raise ValueError(f"devices={devices!r}: 'free:N' needs an integer N. {ACCEPTED}") from None
    if n <= 0 and n != -1:
        raise ValueError(f"devices={devices!r}: 'free:N' needs N > 0. {ACCEPTED}")
    return None if n == -1 else n


def _with_backend(plan: DevicePlan, backend: str | None) -> DevicePlan:
    if backend is None:
        return plan
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known. Accepted: {', '.join(BACKENDS)} "
                         "(or None for nccl on GPU, gloo on CPU).")
    if backend == "nccl" and plan.accelerator == "cpu":
        raise ValueError("backend='nccl' needs GPUs, and this launch runs on CPU. Use 'gloo' (the default on CPU).")
    return DevicePlan(plan.accelerator, plan.indices, plan.physical, backend, plan.num_nodes)
