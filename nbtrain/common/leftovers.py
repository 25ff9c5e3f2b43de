"""What a killed kernel leaves behind: files and directories named after its pid.

A launch removes its own on the way out; a kernel killed with `kill -9` cannot, so each new
launch removes the ones whose kernel is gone (and that belong to this user).
"""
from __future__ import annotations

import os
import re
from collections.abc import Callable

import psutil


def alive(pid: int) -> bool:
    """Whether some process (this user's or another's) has pid `pid`."""
    return psutil.pid_exists(pid)


def remove_orphans(root: str, name: re.Pattern, remove: Callable[[str], None]) -> None:
    """`remove(path)` for each entry of `root` whose whole name matches `name` (group 1: the
    pid of the kernel that made it), owned by this user, and whose kernel has died."""
    for entry in os.listdir(root):  # a shared /tmp holds hundreds of others' entries: match first
        owner = name.fullmatch(entry)
        if owner is None:
            continue
        path = os.path.join(root, entry)
        try:
            if os.stat(path).st_uid == os.getuid() and not alive(int(owner.group(1))):
                remove(path)
        except OSError:  # gone meanwhile
            pass
