"""Checks made in the kernel before any rank starts; each error says what to do."""
from __future__ import annotations

import sys


class ForkUnsafeError(RuntimeError):
    """Forking ranks from this kernel would fail inside the ranks; refused up front."""


FORK_ALTERNATIVES = (
    "Use strategy='ddp_spawn' or strategy='ddp' (fresh processes), or restart the kernel and keep "
    "all CUDA work inside the training function."
)


def fork_blocker() -> str | None:
    """Why forking ranks from this process is unsafe, or None when it is safe."""
    if sys.platform == "win32":
        return "fork is not available on Windows"
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return ("CUDA is already initialised in this kernel, and a forked process cannot "
                "re-initialise it ('Cannot re-initialize CUDA in forked subprocess')")
    return None


def check_fork() -> None:
    reason = fork_blocker()
    if reason:
        raise ForkUnsafeError(f"strategy='ddp_fork' refused: {reason}. {FORK_ALTERNATIVES}")
