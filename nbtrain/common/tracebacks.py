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


def _library_roots() -> tuple[str, ...]:
    import site
    import sysconfig

    roots = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(site.getsitepackages() + [site.getusersitepackages()])
    return tuple(sorted((root.rstrip("/") + "/" for root in roots if root), key=len, reverse=True))


def _frame_file(line: str) -> str | None:
    """The file of a frame's first line ("" for a cell already named), None for other lines."""
    if line.startswith("  Cell In["):
        return ""
    match = FILE_LINE.search(line) if line.startswith('  File "') else None
    return match["file"] if match else None


def fold_library_frames(traceback: str) -> str:
    """A traceback as a reader of their own code wants it: runs of frames inside installed
    packages or the standard library fold into one line naming the packages, and the frame that
    raised stays, its path cut to where the package starts. The full text stays in
    `WorkerError.traceback`."""
    roots = _library_roots()

    def library(path: str) -> str | None:  # the path from the package on, for a library frame
        return next((path[len(root):] for root in roots if path.startswith(root)), None)

    lines, out, run = traceback.splitlines(), [], []

    def shortened(frame) -> list[str]:
        path, block = frame
        return [block[0].replace(path, library(path), 1), *block[1:]]

    def flush(keep_last: bool) -> None:
        frames, last = (run[:-1], run[-1]) if keep_last and run else (list(run), None)
        if len(frames) > 1:
            packages = sorted({library(path).split("/")[0].removesuffix(".py") for path, _ in frames})
            out.append(f"  ... {len(frames)} frames in {', '.join(packages)}")
        elif frames:
            out.extend(shortened(frames[0]))
        if last is not None:
            out.extend(shortened(last))
        run.clear()

    i = 0
    while i < len(lines):
        path = _frame_file(lines[i])
        block = [lines[i]]
        i += 1
        while path is not None and i < len(lines) and lines[i].startswith("    "):
            block.append(lines[i])  # the frame's source line and its carets
            i += 1
        if path and library(path) is not None:
            run.append((path, block))
            continue
        last_frame = path is None and run  # the run ends the traceback: its last frame raised
        flush(keep_last=bool(last_frame))
        out.extend(block)
    flush(keep_last=True)
    return "\n".join(out)


def readable(traceback: str, shell=None) -> str:
    """What the notebook shows of a rank's traceback: cells named, library frames folded."""
    return name_cells(fold_library_frames(traceback), shell)
