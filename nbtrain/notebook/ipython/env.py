"""Where this kernel runs: Colab, Kaggle, VS Code, another Jupyter front end, or a plain process.

Used to explain the platform's quirks (README, troubleshooting) and by the widget layer: Colab
needs its custom widget manager for ipywidgets 8; Kaggle and VS Code render widgets as they are.
"""
from __future__ import annotations

import os
import sys

from ...display import in_jupyter

QUIRKS = {
    "colab": "ipywidgets 8 needs Colab's custom widget manager (nbtrain enables it); restart the runtime once "
             "after `%pip install nbtrain`.",
    "kaggle": "2x T4: devices='auto' uses both GPUs with nccl; restart the session once after installing; if an "
              "import initialised CUDA (fastai does), start='auto' uses the warm template and names the import.",
    "vscode": "widgets render as in Jupyter.",
    "jupyter": "",
    "terminal": "no widgets: progress is printed as text.",
}


def environment(environ=os.environ, modules=sys.modules) -> str:
    """'colab', 'kaggle', 'vscode', 'jupyter' or 'terminal'."""
    if "google.colab" in modules or "COLAB_RELEASE_TAG" in environ:
        return "colab"
    if "KAGGLE_KERNEL_RUN_TYPE" in environ or "KAGGLE_URL_BASE" in environ:
        return "kaggle"
    if "VSCODE_PID" in environ or "VSCODE_CWD" in environ:
        return "vscode"

    return "jupyter" if in_jupyter() else "terminal"
