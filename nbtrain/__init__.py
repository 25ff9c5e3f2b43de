"""nbtrain: multi-device PyTorch training from a Jupyter notebook."""
from .context import Context, context, rank_zero_only
from .devices import DevicePlan, ensure_pci_bus_order, parse_devices, plan_devices
from .errors import UnpicklableError, WorkerError
from .inventory import Gpu, GpuProcess, StaticInventory, find_free_gpus, gpus, use_inventory
from .launch import launch
from .result import Result

ensure_pci_bus_order()

__version__ = "0.1.0"
