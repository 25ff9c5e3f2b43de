"""What a pool keeps of its ranks' messages, noted as each message is taken from the inbox, by
whoever takes it: whose link closed, which command each began, whose output is complete, the
stderr lines that explain a crash, and which output lines go to the cell."""
from __future__ import annotations

from collections import defaultdict, deque

from ...common import protocol
from . import stacks
from .chatter import Chatter

STDERR_TAIL = 300  # lines of a rank's stderr kept to explain a crash


class RankNotes:
    def __init__(self) -> None:
        self._closed: set[int] = set()  # ranks whose channel closed
        self._stderr: dict[int, deque] = defaultdict(lambda: deque(maxlen=STDERR_TAIL))
        self._dying: set[int] = set()  # ranks that wrote faulthandler's fatal report
        self._chatter = Chatter()  # third-party start-up lines: once per launch, or not at all
        self._current: dict[int, int] = {}  # rank: the seq of the command it last began
        self._marks: dict[tuple, int] = {}  # (rank, stream): the seq whose output is complete

    def note(self, message) -> None:
        """What is kept of a message, whoever handles it."""
        rank = message.rank
        if isinstance(message, protocol.Closed):
            self._closed.add(rank)
        elif isinstance(message, protocol.OutputEnd):
            self._marks[(rank, message.stream)] = message.seq
        elif isinstance(message, protocol.Output) and message.stream == "stderr" and rank is not None:
            self._stderr[rank].append(message.text)
        elif isinstance(message, protocol.Begin):
            self._current[rank] = message.seq

    def shows(self, output: protocol.Output) -> bool:
        """Whether a rank's output line goes to the cell. faulthandler's report of a fatal signal
        (every thread's stack, the kernel's inherited frames, the extension modules: ~70 lines)
        is kept for the error, which shows the part that matters, and not streamed. Third-party
        start-up lines every rank writes alike are shown once (`chatter.py`)."""
        if output.stream == "stderr" and output.rank is not None:
            if output.text.startswith(stacks.FATAL):
                self._dying.add(output.rank)
            return output.rank not in self._dying and self._chatter.shows(output)
        return self._chatter.shows(output)

    def closed(self, rank: int) -> bool:
        return rank in self._closed

    def closed_ranks(self) -> list[int]:
        return sorted(self._closed)

    def began(self, rank: int, seq: int) -> bool:
        """`rank` began command `seq`."""
        return self._current.get(rank) == seq

    def output_done(self, rank: int, seq: int) -> bool:
        """Both of `rank`'s streams carry command `seq`'s end mark."""
        return all(self._marks.get((rank, stream)) == seq for stream in ("stdout", "stderr"))

    def last_words(self, rank: int) -> str:
        """What a crashed rank said last (`stacks.last_words`)."""
        return stacks.last_words(list(self._stderr[rank]))

    def fatal_report(self, rank: int) -> str:
        """faulthandler's report of the fatal signal that ended `rank`, if it wrote one."""
        return stacks.fatal_report(list(self._stderr[rank]))
