"""The logged metrics as a matplotlib figure: the PNG a finished run leaves, and `Result.plot`.

matplotlib is an optional extra (`pip install 'nbtrain[plot]'`): without it the dashboard
still runs and its summary is a table; only the picture is missing. Figures are built with
`matplotlib.figure.Figure` and the Agg canvas, never pyplot, so no global figure state of the
user's session is touched and nothing is shown twice by the inline backend.
"""
from __future__ import annotations

import io
import math

from .chart import MARK_COLOUR, MEAN, change_marks, line_colour, line_label, log_ticks, use_log_scale

MISSING_MATPLOTLIB = ("plotting needs matplotlib, which is not installed: pip install 'nbtrain[plot]' "
                      "(or pip install matplotlib), then restart the kernel.")
PANEL_SIZE = (5.0, 2.4)  # inches per metric
DPI = 100
PNG_COLOURS = 64  # saved notebooks stay small (a panel is ~5 kB) and lines keep their colours


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def lines_by_metric(history, names=()) -> dict[str, dict[int, tuple[list[int], list[float]]]]:
    """{metric: {line: (steps, values)}}; a synced metric has one line (MEAN), others one per rank."""
    wanted = list(names)
    found: dict[str, dict[int, tuple[list[int], list[float]]]] = {}
    first: dict[str, tuple[bool, int]] = {}
    for i, m in enumerate(history):
        first[m.name] = min(first.get(m.name, (True, i)), (m.rank != 0, i))
        if (wanted and m.name not in wanted) or (m.synced and m.rank != 0):
            continue
        steps, values = found.setdefault(m.name, {}).setdefault(MEAN if m.synced else m.rank, ([], []))
        steps.append(m.step)
        values.append(m.value)
    if wanted:
        missing = [n for n in wanted if n not in found]
        if missing:
            logged = sorted({m.name for m in history})
            raise ValueError(f"no metric named {', '.join(map(repr, missing))} was logged; logged: {logged or 'none'}.")
        return {n: found[n] for n in wanted}
    return {n: found[n] for n in sorted(found, key=first.__getitem__)}  # as rank 0 logged them


def metrics_figure(history, names=(), title: str = "", changes=()):
    """A Figure with one panel per metric (all logged ones unless `names`), a line per rank or the
    mean, and a steered run's `changes` (`protocol.Change`) marked at their steps."""
    try:
        from matplotlib.figure import Figure
    except ImportError as exc:
        raise ImportError(MISSING_MATPLOTLIB) from exc
    metrics = lines_by_metric(history, names)
    if not metrics:
        raise ValueError("no metrics were logged: call ctx.log(name, value) in the training function.")
    columns = 1 if len(metrics) == 1 else 2
    rows = math.ceil(len(metrics) / columns)
    width, height = PANEL_SIZE[0] * columns, PANEL_SIZE[1] * rows + (0.3 if title else 0)
    fig = Figure(figsize=(width, height), dpi=DPI)
    # Fixed margins (inches) rather than a layout engine: drawing takes half the time.
    fig.subplots_adjust(left=0.7 / width, right=1 - 0.15 / width, bottom=0.5 / height,
                        top=1 - (0.6 if title else 0.3) / height, wspace=0.3, hspace=0.6)
    axes = fig.subplots(rows, columns, squeeze=False).ravel()
    for ax, (name, lines) in zip(axes, metrics.items()):
        for key, (steps, values) in sorted(lines.items()):
            ax.plot(steps, values, color=line_colour(key), linewidth=1.3, label=line_label(key))
        finite = [v for _, vs in lines.values() for v in vs if math.isfinite(v)]
        if use_log_scale(name, finite):
            _log_axis(ax, finite)
        low, high = ax.get_xlim()
        for i, (step, label, _) in enumerate(change_marks(changes)):
            ax.axvline(step, color=MARK_COLOUR, linestyle="--", linewidth=0.8)
            left = (step - low) > 0.7 * (high - low)  # near the right edge: the label reads leftward, uncut
            down = -2 - 9 * (i % 2)  # neighbouring labels on two lines, so they do not run into each other
            ax.annotate(label, (step, 1), xycoords=("data", "axes fraction"), xytext=(-2 if left else 2, down),
                        textcoords="offset points", fontsize=7, color=MARK_COLOUR, va="top",
                        ha="right" if left else "left")
        ax.set_title(name, fontsize=10, loc="left")
        ax.set_xlabel("step", fontsize=9)
        ax.tick_params(labelsize=8)
        ax.grid(True, color="#e6e6e6", linewidth=0.6)
        if len(lines) > 1 or MEAN in lines:
            ax.legend(fontsize=7, frameon=False)
    for ax in axes[len(metrics):]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title, fontsize=10)
    return fig


def _log_axis(ax, values: list[float]) -> None:
    # Plain numbers, at least two of them: the live chart's ticks (decades, 1-2-5 steps, or round
    # linear steps when the curve spans less than that). Matplotlib's LogLocator labelled one
    # tick on a loss that stayed within a decade.
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullFormatter, NullLocator

    ax.set_yscale("log")
    ax.yaxis.set_major_locator(FixedLocator(log_ticks(min(values), max(values))))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_minor_formatter(NullFormatter())


def png(fig) -> bytes:
    """The figure as a 64-colour PNG: a line plot looks the same, at about a quarter of the bytes
    (Pillow comes with matplotlib)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from PIL import Image

    canvas = FigureCanvasAgg(fig)
    canvas.draw()
    image = Image.frombuffer("RGBA", canvas.get_width_height(), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    buffer = io.BytesIO()
    image.convert("RGB").quantize(colors=PNG_COLOURS, method=Image.Quantize.MEDIANCUT).save(
        buffer, format="PNG", optimize=True)
    return buffer.getvalue()


def metrics_text(history) -> str:
    """The plot in words: each line's first and last value and its range, for text-only readers."""
    lines = []
    for name, by_line in lines_by_metric(history).items():
        for key, (steps, values) in sorted(by_line.items()):
            finite = [v for v in values if math.isfinite(v)] or [float("nan")]
            lines.append(f"{name} ({line_label(key)}): {values[0]:.4g} -> {values[-1]:.4g} over steps "
                         f"{steps[0]}-{steps[-1]} (min {min(finite):.4g}, max {max(finite):.4g})")
    return "\n".join(lines)


def make_displayable() -> None:
    """Let IPython show a Figure as a PNG even when pyplot (and its inline backend) was never
    imported; the inline backend, when active, registers the same and wins."""
    import sys

    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython is not None else None
    if shell is None:
        return
    from matplotlib.figure import Figure

    formatter = shell.display_formatter.formatters["image/png"]
    try:
        formatter.lookup_by_type(Figure)
    except KeyError:
        formatter.for_type(Figure, png)
