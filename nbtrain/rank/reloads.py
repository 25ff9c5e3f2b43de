"""A live rank follows the notebook's `importlib.reload`: the modules the notebook reloaded are
reloaded here too, from the same files, before the next command runs (`notebook/run/reloads.py`)."""
from __future__ import annotations

import importlib
import sys


def reload_modules(names: list[str]) -> list[str]:
    """Reload those of `names` this rank has imported; the names reloaded."""
    done = []
    for name in names:
        module = sys.modules.get(name)
        if module is not None:
            importlib.reload(module)
            done.append(name)
    return done
