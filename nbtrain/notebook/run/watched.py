"""What the supervisor asks of the ranks' pool while it watches one command: `Pool` offers it, and
`tests/test_supervisor.py` fakes exactly this to test the supervisor's decisions without processes."""
from __future__ import annotations

from typing import Protocol


class Watched(Protocol):
    """What a Supervisor asks of the pool whose command it watches (`pool.Pool` offers it)."""

    # Read-only: the supervisor asks, the pool alone changes them.
    @property
    def live(self) -> bool: ...  # live ranks: interrupted and kept, never stopped for another's failure
    @property
    def remote(self) -> bool: ...  # the ranks run elsewhere: no pids to signal, no py-spy
    @property
    def processes(self) -> tuple: ...  # the rank processes' handles (`placements.base`)
    @property
    def ended_by(self) -> str | None: ...  # who closed the pool under this command ("restarted by .restart()")
    @property
    def broken(self) -> str | None: ...  # why the live ranks take no more work
    @property
    def restart_reason(self) -> str | None: ...  # why the live ranks will be restarted

    def receive(self, timeout: float): ...  # the next message (the pool noted it), or None
    def process_of(self, rank: int): ...
    def closed(self, rank: int) -> bool: ...  # its link closed
    def output_unread(self, rank: int) -> bool: ...  # its last words wait in a pipe only it writes
    def closed_ranks(self) -> list[int]: ...
    def began(self, rank: int) -> bool: ...  # it began this command: its words are about it
    def output_done(self, rank: int) -> bool: ...  # all it printed during this command has come
    def shows(self, output) -> bool: ...  # an output line goes to the cell
    def last_words(self, rank: int) -> str: ...  # what a crashed rank said last
    def answer(self, message, display) -> None: ...  # a Need or a Prompt
    def interrupt(self, ranks: list[int]) -> None: ...
    def ask_stacks(self, pids: dict[int, int | None]) -> None: ...
    def ask_where(self, ranks: list[int]) -> None: ...  # each answers `Whereabouts`
    @property
    def stall(self) -> float | bool | None: ...  # the run's `stall=` (doctor.stall_after)
    def lost(self, proc, code: int, how: str | None = None) -> None: ...  # a rank's process ended
    def stuck(self, ranks: list[int], why: str) -> None: ...  # ranks an interrupt did not free
    def restart_note(self) -> str: ...
    def any_alive(self) -> bool: ...
