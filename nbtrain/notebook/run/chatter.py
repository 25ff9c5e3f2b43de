"""Third-party start-up lines that every rank writes alike, kept out of the cell's way.

A line each rank writes the same way says one thing: it is shown once per launch (the first
rank's), as Lightning's own notebooks show one "Initializing distributed" line. Lines that say
nothing (the profiler's trace points) are not shown. The ranks' output is otherwise untouched.
"""
from __future__ import annotations

import re

from ...common import protocol

# torch.profiler's kineto writes its trace points to fd 2 at every profile's start and stop.
SILENT = re.compile(r"^(USDT|STAGE):\d{4}-\d\d-\d\d \d\d:\d\d:\d\d \d+:\d+ \w+\.cpp:\d+\] ")
ONCE = {
    "lightning": re.compile(r"^Initializing distributed: GLOBAL_RANK: \d+, MEMBER: \d+/\d+$"),
    "deepspeed": re.compile(r"\[real_accelerator\.py:\d+:get_accelerator\] Setting accelerator to "),
}


class Chatter:
    """One launch's (or one set of live ranks') memory of what it has shown once."""

    def __init__(self):
        self.shown: set[str] = set()

    def shows(self, output: protocol.Output) -> bool:
        if output.rank is None:
            return True
        if SILENT.match(output.text):
            return False
        for name, pattern in ONCE.items():
            if pattern.search(output.text):
                if name in self.shown:
                    return False
                self.shown.add(name)
        return True
