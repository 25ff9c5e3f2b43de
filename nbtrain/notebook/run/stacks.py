"""What a rank's stacks say: faulthandler's dumps and py-spy's native frames, read as text.

The supervisor asks a stuck rank for its stacks (`Pool.ask_stacks`) and reads them here: the
rank's own code leads, nbtrain's threads and frames left out (`tidy_stacks`); a main thread that
waits in a collective names the call and the user's line (`blocked_on_peers`); a rank stuck in C
code gets its native frames from py-spy, where it is installed (`native_stack`), shown folded to
those that say something (`fold_native`); a rank that died
of a fatal signal left faulthandler's report on its stderr (`fatal_report`, `last_words`).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess

from ...common.tracebacks import OWN_PACKAGE, package_path, plain_native_stack

NATIVE_LINES = 40  # frames of a stuck rank's native stack kept (`error.stacks`); fewer shown (`fold_native`)
# Native frames that say where a rank waits: a collective (gloo, NCCL, c10d), a lock, a syscall.
SAYS = re.compile(r"gloo|nccl|c10d|ProcessGroup|Work::wait|[Aa]ll[Rr]educe|[Bb]arrier|[Bb]roadcast|"
                  r"pthread_cond|pthread_mutex|futex|lll_lock|sem_wait|sem_timedwait|nanosleep|\bsleep\b|"
                  r"\bpoll\b|epoll_wait|\bselect\b|\brecv|\bread\b|accept|connect|waitpid")
PY_FRAME = re.compile(r"\([^()]*\.py:\d+\)$")  # py-spy's "function (file.py:12)"
NATIVE_WIDTH = 160  # characters of one native frame shown (a C++ template's name runs to thousands)
NATIVE_WAIT = 20.0  # py-spy's reading of one process, at most
NATIVE_HINT = ("(Frames in C/C++ that do not return: a collective waiting for a rank that is elsewhere, a process "
               "group destroyed while a DDP model still used it, or a library's own teardown.)")
LAST_LINES = 40  # of a crashed rank's stderr, when it wrote no fatal report
FATAL = "Fatal Python error"  # the first line of faulthandler's report of a fatal signal
# A C++ exception that ended the process: libstdc++'s terminate handler writes "  what():  ...";
# another library's handler (Ray's, inherited from a kernel that imported ray) may write it inline,
# then reset the signal handlers, so faulthandler's report never comes.
WHAT = "what():"
_WHAT_MESSAGE = re.compile(r"what\(\):\s*(?:\[enforce fail at [^\]]*\]\s*)?(.*?)(?=\s+/\S+\(\+0x|$)", re.M)
OWN_THREADS = ("in _send_loop", "in _receive_loop", "in _watch_parent", "in _read_pipes")  # nbtrain's threads in a rank
# Below it: nbtrain's loop, the launcher, the kernel.
RANK_ENTRY = re.compile(r"in (serve|_execute|_do_\w+|_user_code)$")
LOOP_FILE = "nbtrain/rank/loop.py"  # the command loop's file, as a rank's stack names it (any machine)
# Frames that are not the caller's: an installed package's (another machine's site-packages too)
# or nbtrain's; a user's folder that happens to be named torch/ or nbtrain/ is the user's.
_INSTALLED = re.compile(r"/(site|dist)-packages/")
_FRAME = re.compile(r'^\s*File "(?P<file>[^"]+)", line (?P<line>\d+) in (?P<func>\S+)')
# Where a rank blocks on its peers: torch.distributed's collectives, rendezvous and DDP's start-up syncs.
_DIST_FILES = re.compile(r"torch/distributed/|torch/nn/parallel/distributed\.py")
_BLOCKING = re.compile(r"^(barrier|monitored_barrier|all_reduce|all_gather\w*|broadcast\w*|reduce\w*|gather\w*|"
                       r"scatter\w*|all_to_all\w*|send|recv|isend|irecv|wait|init_process_group|new_group|"
                       r"_store_based_barrier|rendezvous|_env_rendezvous_handler|_create_c10d_store|"
                       r"_verify_param_shape_across_processes|_sync_module_states|_sync_params_and_buffers)$")


def tidy_stacks(dump: str) -> str:
    """faulthandler's dump without nbtrain's own threads and frames, so the user's code leads."""
    blocks = []
    for block in dump.split("\n\n"):
        if any(marker in block for marker in OWN_THREADS):
            continue
        lines = block.splitlines()
        entry = next((i for i, line in enumerate(lines) if RANK_ENTRY.search(line) and LOOP_FILE in line), None)
        blocks.append("\n".join(lines if entry is None else lines[:entry]))
    return "\n\n".join(b for b in blocks if b.strip() and not b.startswith("Extension modules"))


def blocked_on_peers(stack: str) -> str | None:
    """'all_reduce (cell.py line 7 in train)' when the rank's main thread waits on other ranks."""
    for block in stack.split("\n\n"):
        frames = [m for m in map(_FRAME.match, block.splitlines()) if m]
        waits = [i for i, m in enumerate(frames) if _DIST_FILES.search(m["file"]) and _BLOCKING.match(m["func"])]
        if not waits:
            continue
        op = frames[waits[-1]]["func"]  # the outermost torch.distributed call: the one the user made
        caller = next((m for m in frames[waits[-1] + 1:] if not _library(m["file"])), None)
        where = f" ({os.path.basename(caller['file'])} line {caller['line']} in {caller['func']})" if caller else ""
        return f"{op}{where}"
    return None


def _library(path: str) -> bool:
    return package_path(path) is not None or bool(_INSTALLED.search(path)) or _nbtrain_file(path)


def _nbtrain_file(path: str) -> bool:
    """A file of nbtrain installed elsewhere (a rank on another machine, an editable install):
    what follows its last `nbtrain/` is a file of this package."""
    _, found, tail = path.rpartition("nbtrain/")
    return bool(found) and os.path.isfile(os.path.join(OWN_PACKAGE, tail))


def fatal_report(lines: list[str]) -> str:
    """faulthandler's report of the fatal signal that ended a rank, from its stderr lines; "" if none."""
    starts = [i for i, line in enumerate(lines) if line.startswith(FATAL)]
    return "\n".join(lines[starts[-1]:]).strip() if starts else ""


def last_words(lines: list[str]) -> str:
    """What a crashed rank said last: its fatal report, else from its last C++ exception's message
    (a terminate handler's stack after it), else its last stderr lines; tidied."""
    recent = max(len(lines) - 2 * LAST_LINES, 0)  # an exception's message is looked for near the end only
    starts = [i for i, line in enumerate(lines) if line.startswith(FATAL)] or \
        [i for i in range(recent, len(lines)) if WHAT in lines[i]]
    return tidy_stacks("\n".join(lines[starts[-1]:] if starts else lines[-LAST_LINES:]))


def exception_message(words: str) -> str | None:
    """The message of the C++ exception a rank's last words carry ('what(): ...'), without gloo's
    '[enforce fail at file:line]' and a terminate handler's frames on the same line; None if none."""
    found = _WHAT_MESSAGE.findall(words)
    return found[-1].strip() if found else None


def native_stack(pid: int, lines: int = NATIVE_LINES) -> str | None:
    """The main thread's native and Python frames of `pid` (py-spy dump --native), or None
    where py-spy is missing or cannot read the process."""
    spy = shutil.which("py-spy")
    if spy is None:
        return None
    try:
        dump = subprocess.run([spy, "dump", "--native", "--pid", str(pid)], capture_output=True, text=True,
                              timeout=NATIVE_WAIT)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if dump.returncode != 0:
        return f"(py-spy could not read PID {pid}: {dump.stderr.strip()[:200]})"
    main = plain_native_stack(dump.stdout).split("\nThread ")[1:2]  # the first thread py-spy lists is the main one
    frames = [line.strip() for line in ("Thread " + main[0]).splitlines()[1:] if line.strip()] if main else []
    mine = next((i for i, frame in enumerate(frames) if LOOP_FILE in frame), len(frames))  # below: nbtrain's loop
    # Down to the first Python frame (where the native code was entered): below it, the Python
    # stack shown above says the rest better.
    python = next((i + 1 for i, frame in enumerate(frames) if PY_FRAME.search(frame)), mine)
    frames = [f if len(f) <= NATIVE_WIDTH else f[:NATIVE_WIDTH - 3] + "..." for f in frames[:min(mine, python)]]
    return "\n".join(frames[:lines]) + ("\n..." if len(frames) > lines else "")


def fold_native(stack: str) -> str:
    """A native stack folded to the frames that say something — a collective, a lock, a syscall,
    the Python frames — each run of the others counted in one line."""
    lines, folded = [], 0
    for frame in stack.splitlines():
        if SAYS.search(frame) or PY_FRAME.search(frame) or frame == "...":
            if folded:
                lines.append(f"    ({folded} frame{'s' if folded > 1 else ''} folded)")
                folded = 0
            lines.append(frame)
        else:
            folded += 1
    if folded:
        lines.append(f"    ({folded} frame{'s' if folded > 1 else ''} folded)")
    return "\n".join(lines)


def native_note(rank: int, pid: int | None, remote: bool) -> tuple[str, str]:
    """The lines that follow a stuck rank's Python stacks, folded (`fold_native`) and whole:
    its native stack, or how to get it."""
    if remote or not pid:
        return "", ""
    stack = native_stack(pid)
    if stack is None:
        hint = "\n(its native stack: `pip install py-spy` and nbtrain shows it here)"
        return hint, hint
    head = f"\n--- rank {rank} native stack (py-spy) ---\n"
    return f"{head}{fold_native(stack)}\n{NATIVE_HINT}", f"{head}{stack}"
