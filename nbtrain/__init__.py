"""nbtrain: multi-device PyTorch training from a Jupyter notebook."""
from importlib import metadata as _metadata

from . import template  # noqa: F401 - `nbtrain.template.warm_up/stop`, as before the folders
from .common.devices import DevicePlan, ensure_pci_bus_order, parse_devices, plan_devices
from .common.errors import UnpicklableError, WorkerError
from .common.inventory import Gpu, GpuProcess, StaticInventory, find_free_gpus, use_inventory
from .common.pickling import Finding, explain_pickling
from .common.preflight import ForkUnsafeError, install_cuda_init_hook
from .display.gpus import gpus
from .display.picker import GpuPicker, pick_gpus
from .notebook.dropins import notebook_launcher, spawn
from .notebook.env import environment
from .notebook.launch import launch
from .notebook.ranks import Rank, Ranks
from .notebook.export import export
from .notebook.result import Result
from .notebook.runs import Run, attach, runs
from .notebook.submit import submit
from .placements.clusters import Ray, Slurm
from .placements.template_process import warm_up
from .rank.context import Context, context, rank_zero_only

ensure_pci_bus_order()
install_cuda_init_hook()  # so a refused fork can name the line that initialised CUDA

try:  # pyproject.toml is the one place the version is written; read it back from the install
    __version__ = _metadata.version(__name__)
except _metadata.PackageNotFoundError:  # a source tree put on sys.path, never installed
    __version__ = "0+unknown"


def load_ipython_extension(ipython) -> None:
    """`%load_ext nbtrain`: the %nbtrain / %%nbtrain magics. IPython is imported only here."""
    from .notebook.magics import register

    install_cuda_init_hook()  # already in place from the import; a no-op unless torch was reloaded
    register(ipython)
