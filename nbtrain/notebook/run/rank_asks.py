"""What the ranks ask of the notebook while a command runs: the names their code reads that a
rank lacks (`protocol.Need`, answered from the caller's namespace) and a line for a rank's
debugger (`protocol.Prompt`, asked of the notebook's user)."""
from __future__ import annotations

from collections.abc import Callable

from ...common import protocol
from ...common.pickling import explain_pickling, ship_bytes
from ...common.source import shippable


class RankAsks:
    """Answers one pool's ranks; `send(rank, message)` is the pool's channel."""

    def __init__(self, send: Callable[[int, tuple], object]) -> None:
        self._send = send
        self._namespace: dict = {}  # where the running command's missing names come from
        self._answers: dict[tuple, bytes | None] = {}  # this command's, by the names asked
        self._sent: dict[int, dict[str, object]] = {}  # rank: the notebook objects it was sent, by name

    def begin(self, namespace: dict | None) -> None:
        """A command begins: its missing names come from `namespace`."""
        self._namespace, self._answers = namespace or {}, {}

    def answer(self, message, display) -> None:
        """A rank's `Need` (names its code reads) or `Prompt` (its debugger waits for a line)."""
        if isinstance(message, protocol.Need):
            self._answer_need(message.rank, message.seq, message.names, display)
        else:
            self._answer_prompt(message.rank, message.text)

    def _answer_need(self, rank: int, seq: int, names: list[str], display) -> None:
        """A rank lacks names its code reads, or asks again for ones it took from the notebook:
        send those the notebook has, leaving out what this rank already has as it is here."""
        sent = self._sent.setdefault(rank, {})
        fresh = [n for n in names if not (n in sent and self._namespace.get(n, sent) is sent[n])]
        key = tuple(fresh)
        if key not in self._answers:
            self._answers[key] = self._pack_names(fresh, display)
        sent.update((n, self._namespace[n]) for n in fresh if n in self._namespace)
        self._send(rank, protocol.Names(seq, self._answers[key]))

    def _pack_names(self, names: list[str], display) -> bytes | None:
        found = {n: self._namespace[n] for n in names if n in self._namespace and shippable(n, ())}
        if not found:
            return None
        try:
            return ship_bytes(found)
        except Exception:
            bad = {n for n, v in found.items() if explain_pickling(v, "dill", n)}
            for name in sorted(bad):
                lines = [f"  {f.path}: {f.type} — {f.reason}" for f in explain_pickling(found[name], "dill", name)]
                display.note(f"{name!r} cannot be sent to the ranks; define it there instead "
                             f"(ranks.exec or %%ranks):\n" + "\n".join(lines))
            rest = {n: v for n, v in found.items() if n not in bad}
            return ship_bytes(rest) if rest else None

    def _answer_prompt(self, rank: int, prompt: str) -> None:
        """A rank's debugger waits for a line: ask the notebook's user."""
        try:
            line = input(prompt)
        except (EOFError, RuntimeError, NotImplementedError) as exc:  # no stdin here (a script, nbconvert)
            print(f"nbtrain: no input available for rank {rank}'s debugger ({type(exc).__name__}); quitting it.")
            line = "q"
        self._send(rank, protocol.Stdin(line))
