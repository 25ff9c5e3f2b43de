"""Re-run notebooks in a real kernel and save the outputs a reader should see.

    python notebooks/refresh_outputs.py [notebooks/01_quickstart.ipynb ...]   (default: all)

Runs each notebook top to bottom (nbclient, a `python3` kernel, cwd = notebooks/). Finished
runs replace their live dashboards with static summaries by themselves; what this adds:
no widget state is stored, and widget views that remain (the GPU picker is an input and
keeps its widget) are dropped from the saved outputs, leaving their HTML and text, because
a saved widget without its kernel reads "Error displaying widget: model not found".
"""
from __future__ import annotations

import sys
from pathlib import Path

import nbformat
from nbclient import NotebookClient

HERE = Path(__file__).resolve().parent
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"


def refresh(path: Path) -> int:
    notebook = nbformat.read(path, as_version=4)
    NotebookClient(notebook, timeout=600, kernel_name="python3", store_widget_state=False, record_timing=False,
                   resources={"metadata": {"path": str(path.parent)}}).execute()
    notebook.metadata.pop("widgets", None)
    for cell in notebook.cells:
        cell.metadata.pop("execution", None)  # timestamps: noise in every diff
        for output in cell.get("outputs", []):
            output.get("data", {}).pop(WIDGET_VIEW, None)
            output.get("metadata", {}).pop(WIDGET_VIEW, None)
    drop_empty_outputs(notebook)
    nbformat.write(notebook, path)
    return path.stat().st_size


def empty(output) -> bool:
    """An output with nothing to show: the docs site draws it as an empty box (a widget's view once
    its view is dropped, a live view cleared to nothing)."""
    def text(value) -> str:
        return "".join(value) if isinstance(value, list) else str(value)

    if output.get("output_type") == "stream":
        return not text(output.get("text", ""))
    if output.get("output_type") == "display_data":
        return not any(text(value).strip() for value in output.get("data", {}).values())
    return False


def drop_empty_outputs(notebook) -> None:
    for cell in notebook.cells:
        if "outputs" in cell:
            cell.outputs = [output for output in cell.outputs if not empty(output)]


def main(argv: list[str]) -> int:
    for path in [Path(a) for a in argv] or sorted(HERE.glob("*.ipynb")):
        print(f"{path.name}: {refresh(path)} bytes", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
