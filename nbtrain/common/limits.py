"""What a launch says when the process's open-file limit (RLIMIT_NOFILE) runs out.

A bare ``OSError: [Errno 24] Too many open files`` names neither the step nor the need: the
kernel may hold files of its own, and each rank costs the notebook a few descriptors (its
output pipes, its channel, a handle on its process) while it runs.
"""
from __future__ import annotations

import errno
import os
import resource

# Descriptors a launch holds in the notebook at its peak, measured on Linux (2 forked ranks took
# 15, 4 took 26; tests/test_hostile.py holds the word to a real launch): a channel, an output
# reader, a rendezvous, and per rank two output pipes (both ends while it starts), its channel's
# socket pair and a pidfd.
PER_LAUNCH = 4
PER_RANK = 6


def out_of_files(exc: OSError, step: str, ranks: int, launches: int = 1, who: str = "") -> OSError:
    """`exc` said as what ran out, at which step, and what `ranks` ranks in `launches` launches
    need (`who`: how to name them, "2 ranks" by default); `exc` itself when it is not EMFILE. The
    result is an OSError with errno EMFILE still, so ``except OSError`` holds; `.step` keeps the step."""
    if exc.errno != errno.EMFILE:
        return exc
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        held = len(os.listdir("/proc/self/fd"))
    except OSError:  # the listing needs a descriptor too
        held = soft
    need = PER_LAUNCH * launches + PER_RANK * ranks
    enough = max(held + 2 * need, 1024)
    if hard != resource.RLIM_INFINITY:
        enough = min(enough, hard)
    verb = "needs" if ranks == 1 and not who else "need"
    who = who or f"{ranks} rank{'s' if ranks != 1 else ''}"
    error = OSError(errno.EMFILE, (
        f"too many open files while {step}: this process may hold {soft} (RLIMIT_NOFILE) and holds about {held}; "
        f"{who} {verb} about {need} more. Raise the limit: `ulimit -n {enough}` where Jupyter starts, or "
        f"resource.setrlimit(resource.RLIMIT_NOFILE, ({enough}, hard)) in the notebook (hard limit here: "
        f"{'unlimited' if hard == resource.RLIM_INFINITY else hard}), or close files the notebook holds."))
    error.step = step  # type: ignore[attr-defined]
    return error
