"""Errors that reach the notebook. They pickle, because they cross process boundaries."""
from __future__ import annotations


class WorkerError(RuntimeError):
    """A rank failed: it raised, died by a signal, exited non-zero or timed out.

    `rank` is the first rank that failed (the root cause); `traceback` is that worker's own
    traceback or stacks, as text; `others` lists the later failures, one line each.
    """

    def __init__(self, rank: int, summary: str, traceback: str = "", others: tuple[str, ...] = ()):
        self.rank = rank
        self.summary = summary
        self.traceback = traceback
        self.others = tuple(others)
        super().__init__(self._message())

    def _message(self) -> str:
        text = f"rank {self.rank} failed: {self.summary}"
        if self.others:
            text += "\nthen: " + "; ".join(self.others)
        if self.traceback:
            text += f"\n\n--- rank {self.rank} ---\n{self.traceback.rstrip()}"
        return text

    def __reduce__(self):
        return (type(self), (self.rank, self.summary, self.traceback, self.others))

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of the launcher's own frames: the worker's traceback
        # is the one that points at the user's code.
        lines = [f"WorkerError: rank {self.rank} failed: {self.summary}"]
        lines += [f"then: {line}" for line in self.others]
        if self.traceback:
            from .display.tracebacks import name_cells  # notebook files as `Cell In[3]`, like IPython

            lines += ["", f"--- rank {self.rank} ---", *name_cells(self.traceback).rstrip().splitlines()]
        return lines


class UnpicklableError(TypeError):
    """Something that must travel to another process cannot be serialised.

    `what` names the object being shipped; `findings` are `pickling.Finding`s (path, type,
    reason, hint) for each offending leaf.
    """

    def __init__(self, what: str, findings=(), detail: str = ""):
        self.what = what
        self.findings = list(findings)
        self.detail = detail
        super().__init__(self._message())

    def _message(self) -> str:
        lines = [f"{self.what} cannot be sent to the worker processes."]
        for f in self.findings:
            lines.append(f"  {f.path}: {f.type} — {f.reason}")
            if getattr(f, "hint", ""):
                lines.append(f"      hint: {f.hint}")
        if self.detail and not self.findings:
            lines.append(f"  {self.detail}")
        return "\n".join(lines)

    def __reduce__(self):
        return (type(self), (self.what, self.findings, self.detail))

    def _render_traceback_(self) -> list[str]:
        return [f"UnpicklableError: {line}" if i == 0 else line for i, line in enumerate(str(self).splitlines())]
