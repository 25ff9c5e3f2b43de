"""Worker tracebacks as IPython users read them: `Cell In[3], line 31` for notebook code.

A rank's traceback names the file the kernel compiled a cell under (ipykernel:
`/tmp/ipykernel_<pid>/<hash>.py`). The kernel's compiler remembers which execution count
each such file was; `name_cells` asks it, the way IPython's own tracebacks do.
"""
from __future__ import annotations

import functools
import os
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


def _kernel_namer(shell=None):
    """The running kernel's (or `shell`'s) cell namer; None outside IPython."""
    if shell is None:
        ipython = sys.modules.get("IPython")
        shell = ipython.get_ipython() if ipython is not None else None
    return _cell_namer(shell) if shell is not None else None


def place_name(path: str, shell=None) -> str:
    """A file as a verdict names it: a cell of this kernel as IPython does (`In[4]`), else its base name."""
    namer = _kernel_namer(shell)
    named = namer(path) if namer is not None and path else None
    if named:
        return named[1]
    return os.path.basename(path) if path and not path.startswith("<") else path


def name_cells(traceback: str, shell=None) -> str:
    """`traceback` with every file name the kernel knows as a cell replaced by `Cell In[N]`;
    unchanged outside IPython or for files that are not cells."""
    namer = _kernel_namer(shell)
    if namer is None:
        return traceback

    def rename(match: re.Match) -> str:
        named = namer(match["file"])
        return f"{named[0]} {named[1]}, line {match['line']}" if named else match.group(0)

    return FILE_LINE.sub(rename, traceback)


_C = r"(?:\x1b\[[0-9;]*m)*"  # the colours IPython's pdb adds around each part
_PDB_WHERE = re.compile(rf"^(?P<lead>(?:> |-> )?){_C}(?P<file>/[^()\s\x1b]+\.py){_C}\({_C}(?P<line>\d+){_C}\)",
                        re.MULTILINE)


def name_cells_in_pdb(text: str, shell=None) -> str:
    """pdb's `> /tmp/ipykernel_1/2.py(19)forward()` as IPython's debugger says it:
    `> Cell In[2], line 19, forward()`; other files as they are."""
    namer = _kernel_namer(shell)
    if namer is None:
        return text

    def rename(match: re.Match) -> str:
        named = namer(match["file"])
        return f"{match['lead']}{named[0]} {named[1]}, line {match['line']}, " if named else match.group(0)

    return _PDB_WHERE.sub(rename, text)


@functools.lru_cache(maxsize=1)
def _library_roots() -> tuple[str, ...]:
    import site
    import sysconfig

    roots = {sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")}
    roots.update(site.getsitepackages() + [site.getusersitepackages()])
    return tuple(sorted((root.rstrip("/") + "/" for root in roots if root), key=len, reverse=True))


OWN_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # nbtrain/, wherever installed


def package_path(path: str) -> str | None:
    """`path` from its package on (`torch/nn/modules/linear.py`) for a file of an installed
    package, the standard library or nbtrain itself; None for the user's own files."""
    if path.startswith(OWN_PACKAGE + os.sep):
        return os.path.relpath(path, os.path.dirname(OWN_PACKAGE))
    return next((path[len(root):] for root in _library_roots() if path.startswith(root)), None)


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_PAREN_PATH = re.compile(r"\((?P<file>/[^():]+\.py):(?P<line>\d+)\)")


def plain_native_stack(text: str) -> str:
    """py-spy's dump as plain text: no colours, Python files from their package on."""
    def short(match: re.Match) -> str:
        return f"({package_path(match['file']) or match['file']}:{match['line']})"

    return _PAREN_PATH.sub(short, _ANSI.sub("", text))


def _frame_file(line: str) -> str | None:
    """The file of a frame's first line ("" for a cell already named), None for other lines."""
    if line.startswith("  Cell In["):
        return ""
    match = FILE_LINE.search(line) if line.startswith('  File "') else None
    return match["file"] if match else None


def fold_library_frames(traceback: str) -> str:
    """A traceback as a reader of their own code wants it: runs of frames inside installed
    packages, the standard library or nbtrain fold into one line naming the packages; the frame
    that raised (or, in a stack dump listed most recent first, the one running) stays, its path
    cut to where the package starts. The full text stays in `WorkerError.traceback`."""
    lines = traceback.splitlines()
    out: list[str] = []
    run: list = []
    recent_first, at_start, run_at_start = False, True, False

    def shortened(frame) -> list[str]:
        path, block = frame
        return [block[0].replace(path, package_path(path), 1), *block[1:]]

    def flush(section_ends: bool) -> None:
        frames, kept = list(run), []
        if recent_first and run_at_start:
            kept, frames = frames[:1], frames[1:]  # the frame running now
        elif not recent_first and section_ends:
            kept, frames = frames[-1:], frames[:-1]  # the frame that raised
        if recent_first:
            out.extend(line for frame in kept for line in shortened(frame))
        if len(frames) > 1:
            packages = sorted({(package_path(path) or path).split("/")[0].removesuffix(".py") for path, _ in frames})
            out.append(f"  ... {len(frames)} frames in {', '.join(packages)}")
        elif frames:
            out.extend(shortened(frames[0]))
        if not recent_first:
            out.extend(line for frame in kept for line in shortened(frame))
        run.clear()

    i = 0
    while i < len(lines):
        path = _frame_file(lines[i])
        block = [lines[i]]
        i += 1
        while path is not None and i < len(lines) and lines[i].startswith("    "):
            block.append(lines[i])  # the frame's source line and its carets
            i += 1
        if path and package_path(path) is not None:
            run_at_start = run_at_start if run else at_start
            run.append((path, block))
            at_start = False
            continue
        if run:
            flush(section_ends=path is None)
        if path is None:  # a header, the error, a blank: a new section may start
            recent_first = ("most recent call first" in block[0]
                            or (recent_first and "most recent call last" not in block[0]))
            at_start = True
        else:
            at_start = False
        out.extend(block)
    if run:
        flush(section_ends=True)
    return "\n".join(out)


def readable(traceback: str, shell=None) -> str:
    """What the notebook shows of a rank's traceback: cells named, library frames folded."""
    return name_cells(fold_library_frames(traceback), shell)
