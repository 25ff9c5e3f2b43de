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
    """Visible GPUs with memory, utilisation and processes; empty when there is no GPU or NVML."""
    return GpuTable(visible_gpus(inventory))
