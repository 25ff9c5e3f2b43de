"""`pick_gpus()`: choose GPUs in a widget; `launch(fn, devices=picker)` runs on the selection.

The table refreshes every `refresh` seconds on a daemon thread that holds the picker only
weakly and stops on `close()`, when the widget is closed, when the picker is garbage
collected, or at interpreter exit: no thread outlives what it draws.
"""
from __future__ import annotations

import atexit
import html
import logging
import os
import threading
import weakref
from collections.abc import Mapping

from ..common.inventory import Gpu, Inventory, describe_holders, find_free_gpus, visible_gpus
from .text import gpu_processes_text, gpu_table, gpu_table_html, memory_bar_html
from .widgets import close_tree, ipython_shell, load_ipywidgets, replace, show

log = logging.getLogger(__name__)

COLUMNS = (("GPU", "9em"), ("name", "16em"), ("memory", "17em"), ("util", "4em"), ("processes (pid name mem)", ""))

_open_pickers: weakref.WeakSet[GpuPicker] = weakref.WeakSet()
_atexit_registered = False


def _close_open_pickers() -> None:
    for picker in list(_open_pickers):
        picker.close()


def _refresh_loop(ref: weakref.ref[GpuPicker], stop: threading.Event, interval: float) -> None:
    # Holds the picker weakly between refreshes so that dropping it ends the thread too.
    while not stop.wait(interval):
        picker = ref()
        if picker is None:
            return
        try:
            picker.refresh()
        except Exception as exc:  # NVML hiccup: keep the last table, try again next time
            log.debug("GPU picker refresh failed: %s", exc)
        del picker


class _GpuRow:
    def __init__(self, w, gpu: Gpu, on_change):
        label = f"GPU {gpu.index}" + (f" (phys {gpu.physical_index})" if gpu.index != gpu.physical_index else "")
        self.check = w.Checkbox(value=False, description=label, indent=False, layout=w.Layout(width=COLUMNS[0][1]))
        self.check.observe(on_change, names="value")
        self.name = w.HTML(layout=w.Layout(width=COLUMNS[1][1]))
        self.memory = w.HTML(layout=w.Layout(width=COLUMNS[2][1]))
        self.util = w.HTML(layout=w.Layout(width=COLUMNS[3][1]))
        self.processes = w.HTML()
        self.box = w.HBox([self.check, self.name, self.memory, self.util, self.processes])
        self.draw(gpu)

    def draw(self, gpu: Gpu) -> None:
        self.gpu = gpu
        self.name.value = html.escape(gpu.name)
        self.memory.value = memory_bar_html(gpu.memory_used, gpu.memory_total)
        self.util.value = "-" if gpu.utilization is None else f"{gpu.utilization}%"
        self.processes.value = html.escape(gpu_processes_text(gpu))


class GpuPicker:
    """A GPU table with a checkbox per GPU; `devices` is the selection (visible indices).

    With no GPU visible it offers a number of CPU ranks instead, and `devices` is that int.
    """

    def __init__(self, inventory: Inventory | None = None, refresh: float | None = 2.0,
                 environ: Mapping[str, str] | None = None):
        w = self._w = load_ipywidgets()
        self._inventory, self._environ = inventory, environ
        self._lock = threading.RLock()  # the refresh thread and the kernel's callbacks both redraw
        self._rows: dict[str, _GpuRow] = {}  # by GPU uuid, so a refresh keeps the selection
        self._gpus: list[Gpu] = []
        self._closed = False
        self._shown_in = None  # the execution count of the cell that last showed the picker,
        self._handle = None  # and that output's display handle
        cores = os.cpu_count() or 1
        self.header = w.HTML()
        self.columns = w.HBox([w.HTML(f"<b>{name}</b>", layout=w.Layout(width=width)) for name, width in COLUMNS])
        self.rows_box = w.VBox()
        self.count = w.BoundedIntText(value=1, min=1, max=1, description="how many", layout=w.Layout(width="11em"))
        self.auto = w.Button(description="auto-select free GPUs", layout=w.Layout(width="13em"))
        self.auto.on_click(lambda _: self.auto_select(self.count.value))
        self.clear = w.Button(description="clear")
        self.clear.on_click(lambda _: self.select([]))
        self.controls = w.HBox([self.auto, self.count, self.clear])
        self.cpu_ranks = w.IntSlider(value=min(2, cores), min=1, max=cores, description="CPU ranks")
        self.message = w.HTML()
        self.widget = w.VBox([self.header, self.columns, self.rows_box, self.controls, self.cpu_ranks, self.message])
        self.widget.observe(self._on_comm, names="comm")
        self.refresh_interval = refresh
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

        self._show(visible_gpus(inventory, environ))
        free = [g.index for g in self._gpus if g.is_free]
        self.count.value = max(1, len(free))
        self.select(free)
        if refresh and self._gpus:
            self._thread = threading.Thread(target=_refresh_loop, args=(weakref.ref(self), self._stop, refresh),
                                            name="nbtrain-gpu-picker", daemon=True)
            self._thread.start()
        global _atexit_registered
        _open_pickers.add(self)
        if not _atexit_registered:
            _atexit_registered = True
            atexit.register(_close_open_pickers)

    # -- the selection -------------------------------------------------------------------
    @property
    def devices(self) -> list[int] | int:
        """Selected GPUs as visible indices; with no GPU visible, the number of CPU ranks."""
        with self._lock:
            if not self._gpus:
                return self.cpu_ranks.value
            return [g.index for g in self._gpus if self._rows[g.uuid].check.value]

    def select(self, indices) -> list[int] | int:
        """Check exactly these visible GPU indices."""
        with self._lock:
            wanted = set(indices)
            unknown = wanted - {g.index for g in self._gpus}
            if unknown:
                raise ValueError(f"GPU {min(unknown)} is not visible; visible: {[g.index for g in self._gpus]}.")
            for g in self._gpus:
                self._rows[g.uuid].check.value = g.index in wanted
            self._describe()
            return self.devices

    def auto_select(self, k: int | None = None) -> list[int] | int:
        """Select `k` GPUs that no process uses (every free one if k is None), via find_free_gpus."""
        try:
            chosen = find_free_gpus(k, self._inventory, self._environ)
        except (RuntimeError, ValueError) as exc:
            self._say(str(exc), error=True)
            return self.devices
        if k is not None:
            self.count.value = min(max(1, k), self.count.max)  # the box says what was asked for
        return self.select(chosen)

    # -- drawing -------------------------------------------------------------------------
    def refresh(self) -> None:
        """Read the inventory again and redraw; the selection is kept for GPUs still visible."""
        self._show(visible_gpus(self._inventory, self._environ))

    def _show(self, gpus: list[Gpu]) -> None:
        with self._lock:
            if [g.uuid for g in gpus] == [g.uuid for g in self._gpus]:
                for g in gpus:
                    self._rows[g.uuid].draw(g)
            else:
                rows = {g.uuid: self._rows.get(g.uuid) or _GpuRow(self._w, g, self._on_check) for g in gpus}
                for g in gpus:
                    rows[g.uuid].draw(g)
                self._rows = rows
                self.rows_box.children = [rows[g.uuid].box for g in gpus]
            self._gpus = gpus
            self._layout()
            self._describe()

    def _layout(self) -> None:
        gpus = self._gpus
        shown, hidden = ("", "none") if gpus else ("none", "")
        self.columns.layout.display = self.rows_box.layout.display = self.controls.layout.display = shown
        self.cpu_ranks.layout.display = hidden
        free = sum(g.is_free for g in gpus)
        self.count.max = max(1, len(gpus))
        if not gpus:
            cvd = (self._environ or os.environ).get("CUDA_VISIBLE_DEVICES")
            why = f" (CUDA_VISIBLE_DEVICES={cvd!r})" if cvd is not None else ""
            self.header.value = f"<b>No GPU visible</b>{html.escape(why)}: choose a number of CPU ranks instead."
            return
        cvd = (self._environ or os.environ).get("CUDA_VISIBLE_DEVICES")
        parts = [f"<b>{len(gpus)} GPU{'s' if len(gpus) != 1 else ''} visible</b>", f"{free} free"]
        if cvd is not None:
            parts.append(f"CUDA_VISIBLE_DEVICES={html.escape(cvd)}")
        if self.refresh_interval:
            parts.append(f"refreshed every {self.refresh_interval:g} s")
        self.header.value = " · ".join(parts)

    def _on_check(self, change) -> None:
        self._describe()

    def _describe(self) -> None:
        devices = self.devices
        if not self._gpus:
            self._say(f"{devices} CPU rank{'s' if devices != 1 else ''}: nbtrain.launch(fn, devices=picker)")
            return
        assert isinstance(devices, list)  # GPUs are visible: a selection, not a count
        busy = [g for g in self._gpus if g.index in devices and not g.is_free]
        text = f"selected: {devices}" + (": nbtrain.launch(fn, devices=picker)" if devices else "")
        warning = "; ".join(f"GPU {g.index} is in use by {describe_holders(g)}" for g in busy)
        self._say(text + (f" — {warning}" if warning else ""), error=bool(busy) or not devices)

    def _say(self, text: str, error: bool = False) -> None:
        colour = "#c62828" if error else "#333"
        self.message.value = f'<span style="color:{colour}">{html.escape(text)}</span>'

    # -- lifetime ------------------------------------------------------------------------
    def _on_comm(self, change) -> None:
        if change["new"] is None:  # the widget was closed: nothing left to refresh
            self.close()

    def close(self) -> None:
        """Stop refreshing and close the widget; `devices` keeps answering."""
        if self._closed:
            return
        self._closed = True
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5.0)
        _open_pickers.discard(self)

        close_tree(self.widget, *(row.box for row in self._rows.values()))

    def __del__(self) -> None:
        stop = getattr(self, "_stop", None)
        if stop is not None:
            stop.set()

    def __repr__(self) -> str:
        return f"GpuPicker(devices={self.devices!r})"

    def __str__(self) -> str:
        if not self._gpus:
            return f"{gpu_table(self._gpus)}\nselected: {self.devices} CPU rank{'s' if self.devices != 1 else ''}"
        return f"{gpu_table(self._gpus)}\nselected: {self.devices}"

    def _repr_html_(self) -> str:
        return f"{gpu_table_html(self._gpus)}<p>selected: {html.escape(str(self.devices))}</p>"

    def _bundle(self) -> dict:
        bundle = self.widget._repr_mimebundle_() if not self._closed else {}
        return {**bundle, "text/html": self._repr_html_(), "text/plain": str(self)}

    def show(self) -> None:
        """Display the picker in the running cell (again); where widgets do not render (nbviewer,
        GitHub, a terminal) the GPU table and the selection as HTML and text."""
        self._handle = show(self._bundle(), display_id=True)
        self._shown_in = getattr(ipython_shell(), "execution_count", None)

    def _ipython_display_(self) -> None:
        # `picker` (or `nbtrain.pick_gpus()`) as a cell's last line: the picker once, not the
        # widget and then its repr. If this cell already showed it, that output is refreshed
        # instead, so its text reads the selection made since (say, by auto_select).

        if self._handle is not None and getattr(ipython_shell(), "execution_count", None) == self._shown_in:
            replace(self._handle, self._bundle())
        else:
            self.show()


def pick_gpus(inventory: Inventory | None = None, refresh: float | None = 2.0) -> GpuPicker:
    """A GPU picker: tick GPUs (or have the free ones chosen), then ``launch(fn, devices=picker)``.

    In Jupyter it shows memory bars, processes and checkboxes, updated live; elsewhere a table.
    In IPython it shows itself, so ``picker = nbtrain.pick_gpus()`` displays it;
    ``picker.show()`` displays it again.

    Parameters
    ----------
    inventory : Inventory, optional
        Where the facts come from; default NVML (a ``StaticInventory`` stands in for a demo).
    refresh : float, optional, default 2.0
        Seconds between live updates; None or 0: no refresh thread.

    Returns
    -------
    GpuPicker
        ``picker.devices`` is the selection (a list of indices); pass the picker as ``devices=``
        (the class is not a public name to test with ``isinstance``).
    """
    picker = GpuPicker(inventory, refresh)
    if ipython_shell() is not None:
        picker.show()
    return picker
