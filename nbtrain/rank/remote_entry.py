"""A rank's entry where an engine (SLURM, Ray) started its process, on the notebook's machine or
another: the environment fitted to the machine it landed on, the notebook's channel checked
reachable, then the rank's loop (`loop.remote_main`)."""
from __future__ import annotations

import os
import socket
import sys

from ..common.channel_dial import ADDRESS_VAR, CONNECT_SECONDS, HANDSHAKE_SECONDS, addresses
from ..common.happy_eyeballs import NoneAnswered, first_to_answer
from ..common.tensor_files import ENABLE_VAR as SHARED_MEMORY_VAR  # "0": a rank returns tensors as bytes
from .loop import NOTICE_VAR, remote_main

MACHINE_VAR = "NBTRAIN_KERNEL_MACHINE"  # the notebook's machine, so a rank can tell whether it shares it
PATH_VAR, CWD_VAR = "NBTRAIN_KERNEL_PATH", "NBTRAIN_KERNEL_CWD"  # the notebook's sys.path and directory


def machine_identity() -> str:
    """This machine as seen from a process: its name, its boot, and its /dev/shm. Ranks with the
    notebook's identity may hand results over through shared memory; any other must not."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    try:
        shm = os.stat("/dev/shm")
        memory = f"{shm.st_dev}:{shm.st_ino}"
    except OSError:
        memory = ""
    return f"{socket.gethostname()}/{boot}/{memory}"


def rank_entry(environ: dict[str, str], first: tuple | None, live: bool) -> int:
    """A remote rank's entry, in the process the engine started: the exit code."""
    environ = here(environ)
    check_reachable(environ, int(environ["RANK"]))
    return remote_main(environ, first, live)


def here(environ: dict[str, str]) -> dict[str, str]:
    """A rank's environment fitted to the machine it landed on (its own copy)."""
    environ = dict(environ)
    if environ.pop(MACHINE_VAR, None) != machine_identity():
        environ[SHARED_MEMORY_VAR] = "0"  # the notebook cannot map this machine's memory
    missing = _as_in_the_notebook(environ.pop(PATH_VAR, ""), environ.pop(CWD_VAR, ""))
    if missing and environ.get("LOCAL_RANK", "0") == "0":  # said once per node
        environ[NOTICE_VAR] = (f"the notebook's directory {missing} is not on {socket.gethostname()}: the ranks "
                               f"there run in {os.getcwd()} and import only what is installed there (a file system "
                               "the nodes share makes the notebook's modules and relative paths theirs too)")
    return environ


def _as_in_the_notebook(path: str, cwd: str) -> str | None:
    """The notebook's directory and import path, where this machine has them (a shared file
    system): the user's own modules and relative paths then mean what they mean there. The
    notebook's directory if this machine lacks it."""
    sys.path[:0] = [p for p in path.split(os.pathsep) if p and p not in sys.path and os.path.isdir(p)]
    if cwd and os.path.isdir(cwd):
        os.chdir(cwd)
        return None
    return cwd or None


def check_reachable(environ: dict[str, str], rank: int) -> None:
    """Put the notebook's address this machine connects to first at the front (all are tried at
    once, staggered: one that drops packets silently does not hold up the rest), or fail with a
    message that says what was tried and what to do (a firewall, an address that only resolves
    on the notebook's side, a loopback-only host name)."""
    candidates = addresses(environ[ADDRESS_VAR])
    seconds = max(HANDSHAKE_SECONDS, CONNECT_SECONDS / len(candidates))
    try:
        i, _ = first_to_answer(candidates, lambda sock, left: None, seconds)  # connected is enough here
    except NoneAnswered as failed:
        tried = [f"{host}:{port} ({type(exc).__name__}: {exc})" for (host, port), exc in failed.reasons.items()]
    else:
        environ[ADDRESS_VAR] = ",".join(f"{h}:{p}" for h, p in [candidates[i], *candidates[:i], *candidates[i + 1:]])
        return
    where = f"at {tried[0]}" if len(tried) == 1 else f"at any of {', '.join(tried)}"
    raise ConnectionError(
        f"rank {rank} on {socket.gethostname()} cannot reach the notebook's channel {where}. The nodes must be "
        "able to connect to the notebook's machine: give the cluster object notebook_address='<an address of that "
        "machine the nodes can reach>'.") from None
