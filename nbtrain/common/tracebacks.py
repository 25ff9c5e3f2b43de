"""Worker tracebacks as IPython users read them: `Cell In[3], line 31` for notebook code.

A rank's traceback names the file the kernel compiled a cell under (ipykernel:
`/tmp/ipykernel_<pid>/<hash>.py`). The kernel's compiler remembers which execution count
each such file was; `name_cells` asks it, the way IPython's own tracebacks do.
"""
from __future__ import annotations

import re
import sys

FILE_LINE = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def _cell_namer(shell):
    compiler = getattr(shell, "compile", None)
    name = getattr(compiler, "format_code_name", None)  # IPython >= 8
    if name is not None:
        return name
    known = getattr(compiler, "_filename_map", None)
    if isinstance(known, dict):
        return lambda filename: ("Cell", f"In[{known[filename]}]") if filename in known else None
    return None


def name_cells(traceback: str, shell=None) -> str:
    """`traceback` with every file name the kernel knows as a cell replaced by `Cell In[N]`;
    unchanged outside IPython or for files that are not cells."""
    if shell is None:
        ipython = sys.modules.get("IPython")
        shell = ipython.get_ipython() if ipython is not None else None
    namer = _cell_namer(shell) if shell is not None else None
    if namer is None:
        return traceback

    def rename(match: re.Match) -> str:
        named = namer(match["file"])
        return f"{named[0]} {named[1]}, line {match['line']}" if named else match.group(0)

    return FILE_LINE.sub(rename, traceback)
