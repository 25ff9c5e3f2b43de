"""`nbtrain.gpus()`: the visible GPUs, as a list that shows itself as a table.

The inventory (`inventory.py`) only reads what GPUs exist; showing them is this layer's job,
so the list type and its reprs live here and call the renderers in `text.py`.
"""
from __future__ import annotations

from ..common.inventory import Inventory, visible_gpus
from .text import gpu_table, gpu_table_html


class GpuTable(list):
    """The visible GPUs (`Gpu` objects); a table in a terminal and in a notebook."""

    def __str__(self) -> str:
        return gpu_table(self)

    def _repr_pretty_(self, printer, cycle) -> None:
        printer.text(str(self))

    def _repr_html_(self) -> str:
        return gpu_table_html(self)


def gpus(inventory: Inventory | None = None) -> GpuTable:
    """The visible GPUs: memory, utilisation and the processes on each, read through NVML.

    Respects ``CUDA_VISIBLE_DEVICES`` and ``CUDA_DEVICE_ORDER``, and creates no CUDA context in
    the kernel (forking ranks stays possible). Shown as a table in a notebook and a terminal.

    Parameters
    ----------
    inventory : Inventory, optional
        Where the facts come from; default NVML (a ``StaticInventory`` stands in for a demo).

    Returns
    -------
    GpuTable
        A list of ``Gpu`` (index, name, memory, utilisation, processes); empty when there is no
        GPU or no NVML.
    """
    return GpuTable(visible_gpus(inventory))
