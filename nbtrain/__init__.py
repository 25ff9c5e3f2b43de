"""nbtrain: multi-device PyTorch training from a Jupyter notebook.

The public names load on first use (PEP 562): `import nbtrain` and `nbtrain --version` stay
light, and torch is imported by the first name that needs it, not by the package.
"""
import importlib as _importlib
from importlib import metadata as _metadata

from .common.devices import ensure_pci_bus_order as _ensure_pci_bus_order
from .common.preflight import install_cuda_init_hook_when_imported as _install_cuda_init_hook

# What a notebook user types, and nothing else (name: the module that defines it). Each has a
# docstring with every parameter, what it returns and what it raises (tests/test_public_api.py).
_PUBLIC = {
    **dict.fromkeys(["launch"], ".notebook.run.launch"),
    **dict.fromkeys(["submit"], ".notebook.detached.submit"),
    **dict.fromkeys(["Ranks"], ".notebook.live.ranks"),
    **dict.fromkeys(["context", "Context"], ".rank.context"),
    **dict.fromkeys(["Result"], ".notebook.run.result"),
    **dict.fromkeys(["Run", "attach"], ".notebook.detached.runs"),
    **dict.fromkeys(["runs"], ".notebook.detached.listing"),
    **dict.fromkeys(["export"], ".notebook.detached.export"),
    **dict.fromkeys(["sweep"], ".notebook.many.sweep"),
    **dict.fromkeys(["MapError", "map"], ".notebook.many.mapping"),
    **dict.fromkeys(["NbtrainError", "WorkerError"], ".common.errors"),
    **dict.fromkeys(["explain_pickling"], ".common.pickling"),
    **dict.fromkeys(["gpus"], ".display.gpus"),
    **dict.fromkeys(["pick_gpus"], ".display.picker"),
    **dict.fromkeys(["Ray", "Slurm"], ".placements.clusters"),
    **dict.fromkeys(["MLflow", "TensorBoard", "WandB"], ".rank.trackers"),
    **dict.fromkeys(["Profile"], ".rank.profiling"),
    **dict.fromkeys(["stop_template", "warm_up"], ".placements.template_process"),
}
# Top-level names of earlier releases that are not what a notebook types: they still work until
# REMOVED_IN, with a DeprecationWarning (once per name) saying what public name to use instead.
REMOVED_IN = "0.3"
_INSTEAD = {
    **dict.fromkeys(["DevicePlan", "parse_devices", "plan_devices"],
                    "give the same devices= to nbtrain.launch instead (Result.devices says what it chose)"),
    **dict.fromkeys(["ensure_pci_bus_order", "install_cuda_init_hook"],
                    "nothing replaces it: importing nbtrain does it"),
    **dict.fromkeys(["UnpicklableError", "ForkUnsafeError"], "catch nbtrain.NbtrainError instead"),
    **dict.fromkeys(["Gpu", "GpuProcess", "StaticInventory", "find_free_gpus", "use_inventory"],
                    "use nbtrain.gpus(), or devices='free:N' in nbtrain.launch, instead"),
    "Finding": "nbtrain.explain_pickling returns them",
    "GpuPicker": "nbtrain.pick_gpus() returns one",
    # The drop-ins keep their library's signature; the docs' "code you already have" page imports them so.
    "notebook_launcher": "use `from nbtrain.notebook.dropins import notebook_launcher` (Accelerate's signature)",
    "spawn": "use `from nbtrain.notebook.dropins import spawn` (torch.multiprocessing.spawn's signature)",
    "environment": "nothing replaces it: nbtrain adapts to the notebook it runs in",
    "Sweep": "it is what nbtrain.sweep returns",
    "Rank": "it is ranks[i] of an nbtrain.Ranks",
    "rank_zero_only": "use `if nbtrain.context().is_global_zero:` instead",
}
_MOVED = {
    **dict.fromkeys(["DevicePlan", "ensure_pci_bus_order", "parse_devices", "plan_devices"], ".common.devices"),
    **dict.fromkeys(["UnpicklableError"], ".common.errors"),
    **dict.fromkeys(["Gpu", "GpuProcess", "StaticInventory", "find_free_gpus", "use_inventory"], ".common.inventory"),
    **dict.fromkeys(["Finding"], ".common.pickling"),
    **dict.fromkeys(["ForkUnsafeError", "install_cuda_init_hook"], ".common.preflight"),
    **dict.fromkeys(["GpuPicker"], ".display.picker"),
    **dict.fromkeys(["notebook_launcher", "spawn"], ".notebook.dropins"),
    **dict.fromkeys(["environment"], ".notebook.ipython.env"),
    **dict.fromkeys(["Sweep"], ".notebook.many.sweep"),
    **dict.fromkeys(["Rank"], ".notebook.live.ranks"),
    **dict.fromkeys(["rank_zero_only"], ".rank.context"),
}
_SUBMODULES = {"cli", "demo", "notebook", "display", "placements", "rank", "common"}
__all__ = sorted(_PUBLIC)
_warned: set[str] = set()

_ensure_pci_bus_order()
_install_cuda_init_hook()  # so a refused fork can name the line that initialised CUDA

try:  # pyproject.toml is the one place the version is written; read it back from the install
    __version__ = _metadata.version(__name__)
except _metadata.PackageNotFoundError:  # a source tree put on sys.path, never installed
    __version__ = "0+unknown"


def __getattr__(name: str):
    if name not in _PUBLIC and name not in _MOVED and name not in _SUBMODULES:
        raise AttributeError(f"module 'nbtrain' has no attribute {name!r}")
    if name in _MOVED:
        return _moved(name)
    with _interrupt_after():
        if name in _PUBLIC:
            value = getattr(_importlib.import_module(_PUBLIC[name], __name__), name)
        else:
            value = _importlib.import_module(f".{name}", __name__)
        globals()[name] = value  # once loaded, a plain attribute
    return value


def _moved(name: str):
    """An earlier top-level name, from where it lives now. Never kept as an attribute here, so it
    stays out of dir(); the warning is said once per name, at the line that used it."""
    module = f"{__name__}{_MOVED[name]}"
    if name not in _warned:
        _warned.add(name)
        import warnings

        warnings.warn(f"nbtrain.{name} is deprecated and will be removed in nbtrain {REMOVED_IN}; {_INSTEAD[name]}.",
                      DeprecationWarning, stacklevel=3)
    with _interrupt_after():
        return getattr(_importlib.import_module(module), name)


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
    return sorted(set(globals()) | set(_PUBLIC) | _SUBMODULES)  # the moved names are never globals


def load_ipython_extension(ipython) -> None:
    """`%load_ext nbtrain`: the %nbtrain / %%nbtrain magics. IPython is imported only here."""
    from .notebook.ipython.magics import register

    _install_cuda_init_hook()  # already in place from the import; a no-op unless torch was reloaded
    register(ipython)
