"""Errors that reach the notebook. They pickle, because they cross process boundaries."""
from __future__ import annotations

import inspect

from .tracebacks import readable
from .words import ranks_words


class NbtrainError(Exception):
    """The base of every error nbtrain raises for a run: ``except nbtrain.NbtrainError`` catches a
    failed rank (`WorkerError`), a failed map item (`MapError`), what cannot travel to the ranks,
    a refused fork, a tracker, checkpoint, SLURM or Ray failure, and nothing of the user's own.

    Each subclass is also the built-in kind it always was (a `WorkerError` is a RuntimeError, what
    cannot be pickled a TypeError, a checkpoint's failure an OSError), so earlier ``except`` clauses
    still catch them. A bad setting is a plain ValueError or TypeError, raised before anything starts.
    """


class WorkerError(NbtrainError, RuntimeError):
    """A rank failed: it raised, died by a signal, exited non-zero, or stalled past the timeout.

    Raised in the notebook by `launch`, `Ranks`, ``Run.result()`` and the magics. It names the
    rank that failed first (the root cause, not a peer that lost it) and shows that rank's own
    traceback in Jupyter. When the rank's exception could be rebuilt here, the error is also an
    instance of that exception's class, so ``except MyError`` catches it and its attributes are
    there; ``__cause__`` is the rebuilt exception itself.

    Parameters
    ----------
    rank : int
        The first rank that failed.
    summary : str
        Its failure in one line (``"KeyError: 'x'"``, ``"exited with code 3"``, ``"Signal 9 (SIGKILL)
        received by PID 1234"``, ``"timed out after 60 s"``).
    traceback : str, default ''
        That rank's own traceback, or every rank's stack on a timeout, as text.
    others : tuple of str, default ()
        The other ranks' outcomes, one line each ("rank 0: stopped (rank 1 failed)").
    node : str, optional
        The machine the rank ran on, for ranks on a cluster (None on this machine).
    stacks : dict, optional
        On a timeout or a stall, every rank's full stacks (Python and native) by rank, as text:
        the traceback shows them folded to the frames that say something.

    Attributes
    ----------
    rank, summary, traceback, others, node, stacks
        As given (``stacks`` is ``{}`` when not given).
    """

    @classmethod
    def from_failure(cls, rank: int, summary: str, traceback: str = "", others: tuple[str, ...] = (),
                     original: BaseException | None = None, node: str | None = None,
                     stacks: dict | None = None) -> WorkerError:
        """The error for a failed rank, an instance of ``type(original)`` too when that can be made.

        Parameters
        ----------
        rank, summary, traceback, others, node, stacks
            As for the class.
        original : BaseException, optional
            The rank's exception, rebuilt in the notebook.

        Returns
        -------
        WorkerError
        """
        both = _with_original_class(type(original)) if isinstance(original, Exception) else None
        try:
            error = (both or cls)(rank, summary, traceback, others, node, stacks)
        except Exception:  # the original class's __new__ wants arguments of its own (ExceptionGroup)
            both, error = None, cls(rank, summary, traceback, others, node, stacks)
        for name, value in _attributes(original) if both is not None and original is not None else ():
            try:
                setattr(error, name, value)
            except (AttributeError, TypeError):  # read-only: still there through __cause__
                pass
        error.__cause__ = original
        return error

    def __init__(self, rank: int, summary: str, traceback: str = "", others: tuple[str, ...] = (),
                 node: str | None = None, stacks: dict | None = None):
        self.rank = rank
        self.stacks = dict(stacks or {})
        self.summary = summary
        self.traceback = traceback
        self.others = tuple(others)
        self.node = node
        super().__init__(self._message())

    @property
    def _who(self) -> str:
        return f"rank {self.rank}" + (f" (on {self.node})" if self.node else "")

    def _message(self) -> str:
        text = f"{self._who} failed: {self.summary}"
        if self.others:
            text += "\nthen: " + "; ".join(self.others)
        if self.traceback:
            text += f"\n\n--- rank {self.rank} ---\n{readable(self.traceback).rstrip()}"
        return text

    def __reduce__(self):
        return (type(self), (self.rank, self.summary, self.traceback, self.others, self.node, self.stacks))

    def _render_traceback_(self) -> list[str]:
        # IPython shows this instead of the launcher's own frames: the worker's traceback
        # is the one that points at the user's code.
        lines = [f"WorkerError: {self._who} failed: {self.summary}"]
        lines += [f"then: {line}" for line in self.others]
        if self.traceback:
            lines += ["", f"--- rank {self.rank} ---", *readable(self.traceback).rstrip().splitlines()]
        return lines


_OWN_ATTRIBUTES = ("rank", "summary", "traceback", "others", "node", "stacks")
_combined: dict[type, type] = {}  # one class per original class: `type(e) is type(e2)` holds


def _attributes(original: BaseException):
    """The original's own attributes (`.code`), and the C fields of built-in exception classes
    (OSError's errno and filename, StopIteration's value), which live outside its __dict__."""
    names = [n for cls in type(original).__mro__ if cls.__module__ == "builtins" and cls not in (BaseException, object)
             for n, attr in vars(cls).items() if not n.startswith("_") and inspect.isdatadescriptor(attr)]
    names += list(vars(original))
    for name in dict.fromkeys(names):
        if name in _OWN_ATTRIBUTES:
            continue
        try:
            yield name, getattr(original, name)
        except AttributeError:  # a field left unset (OSError.characters_written)
            pass


def _with_original_class(original: type) -> type | None:
    """A subclass of WorkerError and `original`, or None where Python cannot combine them."""
    if issubclass(WorkerError, original) or issubclass(original, WorkerError):  # RuntimeError: nothing to add
        return None
    if original not in _combined:
        try:
            _combined[original] = type("WorkerError", (WorkerError, original), {
                # Named WorkerError, as the notebook shows it (`ename`); the qualname tells them apart.
                "__qualname__": f"WorkerError({original.__qualname__})",
                "__module__": __name__,
                "__reduce__": _reduce_with_original,
                "__getattr__": _attribute_of_original,
                "__str__": WorkerError.__str__,
                "__repr__": WorkerError.__repr__,
            })
        except TypeError:  # incompatible layouts, a class that refuses subclasses
            return None
    return _combined[original]


def _reduce_with_original(self):
    # The combined class is made at run time and cannot be pickled by name: rebuild it.
    return (_rebuild, (self.rank, self.summary, self.traceback, self.others, self.__cause__, self.node, self.stacks))


def _rebuild(rank, summary, traceback, others, original, node=None, stacks=None):
    return WorkerError.from_failure(rank, summary, traceback, others, original=original, node=node, stacks=stacks)


def _attribute_of_original(self, name: str):
    # Only reached when normal lookup failed: what could not be copied (slots, read-only
    # fields) is read from the original.
    cause = self.__cause__
    if cause is None or name.startswith("__"):
        raise AttributeError(name)
    return getattr(cause, name)


def launcher_failed(error: WorkerError) -> WorkerError:
    """`error` as an instance of torch's ``ChildFailedError`` too (what Accelerate's
    `notebook_launcher` raises, and its callers catch), for `nbtrain.notebook_launcher` only.
    The class is made on first use: ``import nbtrain`` imports no torch."""
    failed = _launcher_failed(error.rank, error.summary, error.traceback, error.others, error.node, error.stacks)
    failed.__cause__ = error.__cause__
    return failed


def _launcher_failed(rank, summary, traceback="", others=(), node=None, stacks=None) -> WorkerError:
    return _launcher_failed_class()(rank, summary, traceback, others, node, stacks)


_launcher_failed_classes: list[type] = []


def _launcher_failed_class() -> type:
    if _launcher_failed_classes:
        return _launcher_failed_classes[0]
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    class LauncherFailed(WorkerError, ChildFailedError):
        """A rank of `nbtrain.notebook_launcher` failed: nbtrain's WorkerError and torch's ChildFailedError."""

        def __init__(self, rank, summary, traceback="", others=(), node=None, stacks=None):
            WorkerError.__init__(self, rank, summary, traceback, others, node, stacks)
            failure = ProcessFailure(local_rank=rank, pid=-1, exitcode=1, error_file="")
            failure.message = summary
            self.name, self.failures = "notebook_launcher", {rank: failure}  # as ChildFailedError has them

        __str__ = WorkerError.__str__

        def __reduce__(self):  # made at run time: rebuilt by a function pickle can find
            return (_launcher_failed, (self.rank, self.summary, self.traceback, self.others, self.node, self.stacks))

    LauncherFailed.__qualname__ = "WorkerError(ChildFailedError)"  # named WorkerError, as the notebook shows it
    LauncherFailed.__name__ = "WorkerError"
    _launcher_failed_classes.append(LauncherFailed)
    return LauncherFailed


class UnpicklableError(NbtrainError, TypeError):
    """Something that must travel to another process cannot be serialised.

    `what` names the object being shipped; `findings` are `pickling.Finding`s (path, type,
    reason, hint) for each offending leaf.
    """

    def __init__(self, what: str, findings=(), detail: str = "", advice: str = "", returning: bool = False):
        self.what = what
        self.findings = list(findings)
        self.detail = detail
        self.advice = advice  # a closing line: what to do instead
        self.returning = returning  # a rank's return value, on its way back to the notebook
        super().__init__(self._message())

    def _message(self) -> str:
        where = "cannot travel back to the notebook" if self.returning else "cannot be sent to the worker processes"
        lines = [f"{self.what} {where}."]
        for f in self.findings:
            lines.append(f"  {f.path}: {f.type} — {f.reason}")
            if getattr(f, "hint", ""):
                lines.append(f"      hint: {f.hint}")
        if self.detail and not self.findings:
            lines.append(f"  {self.detail}")
        if self.advice:
            lines.append(self.advice)
        return "\n".join(lines)

    def __reduce__(self):
        return (type(self), (self.what, self.findings, self.detail, self.advice, self.returning))

    def _render_traceback_(self) -> list[str]:
        return [f"UnpicklableError: {line}" if i == 0 else line for i, line in enumerate(str(self).splitlines())]


def interrupt_report(live: bool, ranks: list[int], where: dict[int, str], stuck: list[int],
                     restart: str | None = None) -> list[str]:
    """What a notebook shows for a Ctrl-C that reached the ranks: where each rank's code was
    (ranks interrupted at the same place share one traceback), not the kernel's wait loop.
    `restart`: why the live ranks are restarted, when not because `stuck` ranks did not return."""
    if not live:  # a launch, or live ranks still starting: the ranks are stopped
        return [f"KeyboardInterrupt: interrupted; nbtrain stopped ranks {ranks}."]
    lines = [f"KeyboardInterrupt: the live ranks {ranks} were interrupted; " + (
        f"ranks {sorted(stuck)} did not return, so the live ranks are restarted: their state is lost." if stuck
        else f"{restart}, so the live ranks are restarted: their state is lost." if restart
        else "their state is kept.")]

    places: dict[str, list[int]] = {}
    for rank in sorted(where):
        places.setdefault(where[rank], []).append(rank)
    for traceback, at in places.items():
        label = ranks_words(at)
        lines += ["", f"--- {label} ---", *readable(traceback).rstrip().splitlines()]
    return lines
