"""nbtrain: multi-device PyTorch training from a Jupyter notebook.

The public names load on first use (PEP 562): `import nbtrain` and `nbtrain --version` stay
light, and torch is imported by the first name that needs it, not by the package.
"""
import importlib as _importlib
from importlib import metadata as _metadata

from .common.devices import ensure_pci_bus_order as _ensure_pci_bus_order
from .common.preflight import install_cuda_init_hook_when_imported as _install_cuda_init_hook

# name: the module that defines it
_PUBLIC = {
    **dict.fromkeys(["DevicePlan", "ensure_pci_bus_order", "parse_devices", "plan_devices"], ".common.devices"),
    **dict.fromkeys(["UnpicklableError", "WorkerError"], ".common.errors"),
    **dict.fromkeys(["Gpu", "GpuProcess", "StaticInventory", "find_free_gpus", "use_inventory"], ".common.inventory"),
    **dict.fromkeys(["Finding", "explain_pickling"], ".common.pickling"),
    **dict.fromkeys(["ForkUnsafeError", "install_cuda_init_hook"], ".common.preflight"),
    "gpus": ".display.gpus",
    **dict.fromkeys(["GpuPicker", "pick_gpus"], ".display.picker"),
    **dict.fromkeys(["notebook_launcher", "spawn"], ".notebook.dropins"),
    "environment": ".notebook.env",
    "launch": ".notebook.launch",
    **dict.fromkeys(["MapError", "map"], ".notebook.mapping"),
    **dict.fromkeys(["Rank", "Ranks"], ".notebook.ranks"),
    "Result": ".notebook.result",
    **dict.fromkeys(["Run", "attach", "runs"], ".notebook.runs"),
    "submit": ".notebook.submit",
    **dict.fromkeys(["Sweep", "sweep"], ".notebook.sweep"),
    "export": ".notebook.export",
    **dict.fromkeys(["Ray", "Slurm"], ".placements.clusters"),
    "warm_up": ".placements.template_process",
    **dict.fromkeys(["Context", "context", "rank_zero_only"], ".rank.context"),
    "Profile": ".rank.profiling",
    **dict.fromkeys(["MLflow", "TensorBoard", "WandB"], ".rank.trackers"),
}
_SUBMODULES = {"template", "cli", "demo", "script_rank", "notebook", "display", "placements", "rank", "common"}
__all__ = sorted(_PUBLIC)

_ensure_pci_bus_order()
_install_cuda_init_hook()  # so a refused fork can name the line that initialised CUDA

try:  # pyproject.toml is the one place the version is written; read it back from the install
    __version__ = _metadata.version(__name__)
except _metadata.PackageNotFoundError:  # a source tree put on sys.path, never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    if name not in _PUBLIC and name not in _SUBMODULES:
        raise AttributeError(f"module 'nbtrain' has no attribute {name!r}")
    with _interrupt_after():
        if name in _PUBLIC:
            value = getattr(_importlib.import_module(_PUBLIC[name], __name__), name)
        else:
            value = _importlib.import_module(f".{name}", __name__)
        globals()[name] = value  # once loaded, a plain attribute
    return value


class _interrupt_after:
    """A Ctrl-C during the first use's imports (torch's, seconds) waits for them to finish: torch
    interrupted half-way through its import cannot be imported again in that kernel
    ("cannot initialize type ... already defined")."""

    def __enter__(self):
        import signal
        import threading

        self._signal, self._asked, self._previous = signal, [], None
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, lambda *_: self._asked.append(True))

    def __exit__(self, *exc):
        if self._previous is not None:
            self._signal.signal(self._signal.SIGINT, self._previous)
            if self._asked and exc[0] is None:
                raise KeyboardInterrupt


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_PUBLIC) | _SUBMODULES)


def load_ipython_extension(ipython) -> None:
    """`%load_ext nbtrain`: the %nbtrain / %%nbtrain magics. IPython is imported only here."""
    from .notebook.magics import register

    _install_cuda_init_hook()  # already in place from the import; a no-op unless torch was reloaded
    register(ipython)
