"""Shared by the benchmark scripts: a real Jupyter kernel, medians, and RESULTS.md sections."""
from __future__ import annotations

import datetime
import os
import platform
import re
import statistics
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


class Kernel:
    """A real Jupyter kernel; `run` executes a cell and returns its stdout (raises on error)."""

    def __init__(self, **start):
        """`start`: what KernelManager.start_kernel takes (cwd, env)."""
        from jupyter_client.manager import start_new_kernel

        self.manager, self.client = start_new_kernel(kernel_name="python3", **start)

    def run(self, code: str, timeout: float = 600) -> str:
        out, error = [], []

        def hook(msg):
            if msg["msg_type"] == "stream" and msg["content"]["name"] == "stdout":
                out.append(msg["content"]["text"])
            elif msg["msg_type"] == "error":
                error.append("\n".join(msg["content"]["traceback"]))

        self.client.execute_interactive(code, timeout=timeout, output_hook=hook)
        if error:
            raise RuntimeError(re.sub(r"\x1b\[[0-9;]*m", "", error[0]))
        return "".join(out)

    def close(self) -> None:
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


def machine() -> str:
    return f"{platform.node()} ({os.cpu_count()} cores, {platform.machine()}, Python {platform.python_version()})"


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def record(section: str, body: str) -> None:
    """Replace (or add) `## section` in RESULTS.md with a dated body, and print it."""
    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M")
    text = f"## {section}\n\n{stamp} on {machine()}\n\n{body.strip()}\n"
    print(text)
    old = RESULTS.read_text() if RESULTS.exists() else (
        "# Benchmark results\n\n"
        "Written by the scripts in this folder; each section is replaced when its script runs again.\n")
    pattern = re.compile(rf"^## {re.escape(section)}\n.*?(?=^## |\Z)", re.S | re.M)
    new = pattern.sub(text + "\n", old) if pattern.search(old) else old.rstrip() + "\n\n" + text
    RESULTS.write_text(new)
