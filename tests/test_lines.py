"""common/lines.py: a rank's output stream replayed as a terminal would show it."""
import io
import re

import pytest

from nbtrain.common.lines import Screen
from nbtrain.common.protocol import Live, Output, OutputEnd

ESCAPE = re.compile(r"\x1b\[[0-9;]*[A-Za-ln-z]|\x1b\]|\x1b\[\?")  # anything but colour (SGR, "...m")


class Pipe(io.TextIOBase):
    """What a rank writes, fed to a Screen write by write (each write a chunk, as a pipe may deliver it)."""

    def __init__(self, chunk: int | None = None):
        self.screen, self.events, self.chunk = Screen(), [], chunk

    def write(self, text: str) -> int:
        data = text.encode()
        step = self.chunk or len(data) or 1
        for i in range(0, len(data), step):
            self.events += self.screen.feed(data[i:i + step])
        return len(text)

    def flush(self):
        pass

    def isatty(self):
        return False

    def close_stream(self) -> list[tuple]:
        self.events += self.screen.flush()
        return self.events


def shown(events) -> list[str]:
    """What stays in the cell: finished lines, and each live block's final text."""
    return [e[1] for e in events if e[0] == "line" or (e[0] == "live" and e[2])]


def test_plain_lines_pass_unchanged_and_wait_for_their_end():
    screen = Screen()
    assert screen.feed(b"one\ntw") == [("line", "one")]
    assert screen.feed(b"o\n\nthree") == [("line", "two"), ("line", "")]
    assert screen.flush() == [("line", "three")]
    assert screen.flush() == []


def test_colour_is_kept_other_escapes_are_not():
    screen = Screen()
    events = screen.feed(b"\x1b[?25l\x1b[?25h\x1b]0;title\x07\x1b[31mred\x1b[0m \x1b]8;;http://x\x1b\\link\x1b]8;;\x1b\\\n")
    assert events == [("line", "\x1b[31mred\x1b[0m link")]


def test_a_carriage_return_redraws_one_live_line():
    screen = Screen()
    assert screen.feed(b"\r 10%") == [("live", "10%".rjust(4), False)]
    assert screen.feed(b"\r 20%\r 30%") == [("live", " 30%", False)]  # one event per chunk, the latest state
    assert screen.feed(b"\r100%\n") == [("live", "100%", False)]
    assert screen.feed(b"after\n") == [("live", "100%", True), ("line", "after")]


def test_pieces_cut_anywhere_give_the_same_lines():
    data = "é\x1b[32mgreen\x1b[0m\r\n\x1b[2Kbar 1\rbar 2\n\x00nbtrain-done 7\n".encode()
    whole = Screen()
    expected = shown(whole.feed(data) + whole.flush())
    bytewise = Screen()
    events = [e for i in range(len(data)) for e in bytewise.feed(data[i:i + 1])] + bytewise.flush()
    assert shown(events) == expected == ["é\x1b[32mgreen\x1b[0m", "bar 2", "\x00nbtrain-done 7"]


def test_a_mark_ends_what_came_before_it_even_mid_line():
    screen = Screen()
    events = screen.feed(b"\rstep 3 partial\x00nbtrain-done 4\n")
    assert shown(events) == ["step 3 partial", "\x00nbtrain-done 4"]
    assert screen.flush() == []


@pytest.mark.parametrize("chunk", [None, 7])
def test_tqdm_bar_is_one_line(chunk):
    from tqdm import tqdm

    pipe = Pipe(chunk)
    for _ in tqdm(range(50), file=pipe, mininterval=0, miniters=1, ascii=True, ncols=60):
        pass
    print("done", file=pipe)
    events = pipe.close_stream()
    assert [e for e in events if e[0] == "line"] == [("line", "done")]
    final = [e[1] for e in events if e[0] == "live" and e[2]]
    assert len(final) == 1 and "50/50" in final[0] and "\n" not in final[0]
    assert not any("\r" in e[1] or ESCAPE.search(e[1]) for e in events)


@pytest.mark.parametrize("chunk", [None, 5])
def test_nested_tqdm_bars_and_a_write_between(chunk):
    from tqdm import tqdm

    pipe = Pipe(chunk)
    for epoch in tqdm(range(3), file=pipe, mininterval=0, miniters=1, ascii=True, ncols=60, desc="epoch"):
        for _ in tqdm(range(20), file=pipe, mininterval=0, miniters=1, ascii=True, ncols=60, desc="batch",
                      leave=False):
            pass
        tqdm.write(f"epoch {epoch} loss 0.1", file=pipe)
    print("trained", file=pipe)
    events = pipe.close_stream()
    stays = [line for text in shown(events) for line in text.split("\n")]
    assert [s for s in stays if not s.startswith("epoch:")] == [f"epoch {e} loss 0.1" for e in range(3)] + ["trained"]
    assert sum("3/3" in s for s in stays) == 1  # the outer bar's final state, once
    assert not any("batch" in s for s in stays)  # an inner bar with leave=False leaves nothing
    assert not any("\r" in e[1] or ESCAPE.search(e[1]) for e in events)
    live = [e for e in events if e[0] == "live"]
    assert max(e[1].count("\n") for e in live) <= 2  # drawn as a block of at most a message and two bars


def test_rich_progress_is_one_block():
    rich_progress = pytest.importorskip("rich.progress")
    from rich.console import Console

    pipe = Pipe()
    console = Console(file=pipe, force_terminal=True, width=80)
    with rich_progress.Progress(console=console, auto_refresh=False) as progress:
        a = progress.add_task("a", total=30)
        b = progress.add_task("b", total=30)
        for _ in range(30):
            progress.advance(a)
            progress.advance(b)
            progress.refresh()
    console.print("after")
    events = pipe.close_stream()
    stays = [line for text in shown(events) for line in text.split("\n")]
    assert len([s for s in stays if "a" in s and "100%" in s]) == 1
    assert len([s for s in stays if "b" in s and "100%" in s]) == 1
    assert stays[-1].endswith("after")
    assert not any("\r" in e[1] or ESCAPE.search(e[1]) for e in events)


# -- the one reader that replays rank streams with it, on either side ------------------------------

def _read_all(write_to_pipes, *pipes, rank_of=None):
    """What an OutputReader hands on for what `write_to_pipes(fds)` writes to fresh pipes."""
    import os

    from nbtrain.common.output_reader import OutputReader

    records = []
    reader = OutputReader(records.append)
    ends = []
    for rank, stream in pipes:
        read, write = os.pipe()
        reader.add(read, rank, stream, rank_of)
        ends.append(write)
    reader.start()
    write_to_pipes(ends)
    for fd in ends:
        os.close(fd)
    reader.drain(5.0)
    reader.close()
    return records


def test_the_output_reader_sends_lines_live_redraws_and_the_end_mark():
    import os

    from nbtrain.common.output_reader import end_mark

    records = _read_all(lambda fds: os.write(fds[0], b"plain\n\r 1/2\r 2/2\n" + end_mark(1)), (3, "stderr"))
    # A bar read in one piece with what follows is a line; read apart, a live line: either way once.
    stays = [m.text for m in records if isinstance(m, Output) or (isinstance(m, Live) and m.done)]
    assert stays == ["plain", " 2/2"] and records[-1] == OutputEnd(3, "stderr", 1)
    assert all((m.rank, m.stream) == (3, "stderr") for m in records) and not any("\r" in str(m) for m in records)


def test_a_launchers_prefixed_lines_name_their_rank_and_only_a_whole_mark_ends_output():
    import os

    from nbtrain.common.output_reader import end_mark

    def rank_of(line):  # as torchrun's --tee prefixes them: "[1]:text"
        return int(line[1]), line[4:]

    records = _read_all(lambda fds: os.write(fds[0], b"[1]:hello\n[0]:bye\n"), (None, "stdout"), rank_of=rank_of)
    assert records == [Output(1, "stdout", "hello"), Output(0, "stdout", "bye")]
    records = _read_all(lambda fds: os.write(fds[0], end_mark(3)[:-3] + b"x\n" + end_mark(4)), (2, "stdout"))
    assert records == [Output(2, "stdout", end_mark(3)[:-3].decode() + "x"), OutputEnd(2, "stdout", 4)]


FORWARDS = """
import os, sys, time
from nbtrain.rank import process

out = os.fdopen(os.dup(1), "w", buffering=1)  # the test's own view, before fds 1 and 2 become pipes


class Link:  # what would travel over the channel, in order
    rank = 4

    def emit(self, record):
        out.write(repr(record) + "\\n")


process.forward_output(Link())
print("\\r 1/2\\r 2/2\\nplain")
print("[c10d] The hostname of the client socket cannot be retrieved. err=-3", file=sys.stderr)
sys.stdout.write("partial")
sys.stdout.flush()
process.end_output(7, marked=False)  # a forwarding rank marks the end anyway, and waits for it
out.write("the reply\\n")
"""


@pytest.mark.slow
def test_forwarded_output_redraws_drops_the_unheard_and_goes_before_the_reply():
    import subprocess
    import sys

    lines = subprocess.run([sys.executable, "-c", FORWARDS], capture_output=True, text=True, timeout=60,
                           check=True).stdout.splitlines()
    assert lines[-1] == "the reply"
    records = [eval(line, {"Output": Output, "Live": Live, "OutputEnd": OutputEnd}) for line in lines[:-1]]
    stays = [(m.stream, m.text) for m in records if isinstance(m, Output) or (isinstance(m, Live) and m.done)]
    assert stays == [("stdout", " 2/2"), ("stdout", "plain"), ("stdout", "partial")]
    assert {m for m in records if isinstance(m, OutputEnd)} == {OutputEnd(4, "stdout", 7), OutputEnd(4, "stderr", 7)}
    assert all(m.rank == 4 for m in records)


def test_a_ranks_last_words_in_its_own_pipe_count_as_unread_until_handed_on():
    """The supervisor waits for them before it makes a crashed rank's error (a busy machine reads late)."""
    import os
    import time

    from nbtrain.common.output_reader import OutputReader

    records = []
    reader = OutputReader(records.append)
    own_r, own_w = os.pipe()
    shared_r, shared_w = os.pipe()
    held_r, held_w = os.pipe()  # as when the rank's DataLoader worker outlives it, silent
    reader.add(own_r, 0, "stderr", sole=True)
    reader.add(shared_r, 1, "stderr")  # torchrun's: other writers keep it open, its bytes are not waited for
    reader.add(held_r, 2, "stderr", sole=True)
    try:
        os.write(own_w, b"Fatal Python error: Segmentation fault\n")
        os.close(own_w)
        os.write(shared_w, b"not awaited\n")
        assert reader.unread(0) and not reader.unread(1) and not reader.unread(2) and not reader.unread(7)
        reader.start()
        deadline = time.monotonic() + 5
        while reader.unread(0) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert not reader.unread(0)
        assert Output(0, "stderr", "Fatal Python error: Segmentation fault") in records  # handed on before
    finally:
        reader.close()
        os.close(shared_w)
        os.close(held_w)
