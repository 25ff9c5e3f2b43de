"""display/rank_output.py outside Jupyter (a terminal, a log): a bar's last state as one line, the
shown rank's rich output as its text, the others' counted and said once. (In Jupyter:
tests/test_rank_output.py, in a real kernel.)"""
import io

from nbtrain.common.protocol import ClearOutput, Display, Live, UpdateDisplay
from nbtrain.display.lazy import LazyDisplay
from nbtrain.display.rank_output import deliver
from nbtrain.display.text import LineDisplay, QuietDisplay
from nbtrain.notebook.run.runmodel import RunState

HTML_BUNDLE = {"text/plain": "<IPython.core.display.HTML object>", "text/html": "<b>hi</b>"}


def test_a_bar_leaves_its_last_state_as_lines():
    out = io.StringIO()
    display = QuietDisplay(file=out)
    display.start(RunState("t", [0, 1]))
    display.live(1, "stderr", "bar 10%", False)
    display.live(1, "stderr", "bar 50%", False)
    assert out.getvalue() == ""
    display.live(1, "stderr", "epoch 2/2\nbar 100%", True)
    display.live(0, "stderr", "", True)  # a bar that erased itself: nothing left
    assert out.getvalue() == "[rank 1] epoch 2/2\n[rank 1] bar 100%\n"


def test_rich_output_of_the_shown_rank_as_text_others_counted_once():
    out = io.StringIO()
    display = LineDisplay(file=out)
    state = RunState("fit on 2 CPU ranks", [0, 1, 2])
    display.start(state)
    display.rich(Display(0, HTML_BUNDLE, {}, {"display_id": "a"}))
    display.rich(UpdateDisplay(0, {"text/plain": "updated"}, {}, {"display_id": "a"}))
    display.rich(ClearOutput(0, True))
    for rank in (1, 2, 2):
        display.rich(Display(rank, HTML_BUNDLE, {}, {}))
    display.rich(UpdateDisplay(2, HTML_BUNDLE, {}, {"display_id": "b"}))
    display.finish(state, True)
    lines = out.getvalue().splitlines()
    assert lines[1] == "[rank 0] <IPython.core.display.HTML object>"
    assert "updated" not in out.getvalue()
    assert lines[-1] == ("nbtrain: ranks 1, 2 displayed 3 rich outputs (IPython display: HTML, images, tables) not "
                         "shown here: only rank 0's rich output is shown in the cell.")
    display.start(state)
    display.finish(state, True)
    assert out.getvalue().count("not shown here") == 1  # said for the command it happened in


def test_a_command_to_some_ranks_shows_the_lowest_of_them(capsys):
    display = LazyDisplay(progress=False)  # what live ranks' short commands use
    display.start(RunState("exec on live ranks [2, 3]", [2, 3]))
    display.rich(Display(2, {"text/plain": "from two"}, {}, {}))
    display.rich(Display(3, {"text/plain": "from three"}, {}, {}))
    display.finish(None, True)
    assert capsys.readouterr().out.splitlines() == [
        "[rank 2] from two",
        "nbtrain: rank 3 displayed 1 rich output (IPython display: HTML, images, tables) not shown here: only "
        "rank 2's rich output is shown in the cell."]


def test_a_display_of_ones_own_gets_a_bars_last_lines_as_output():
    class Mine:  # the five methods only
        def __init__(self):
            self.lines = []

        def output(self, rank, stream, text):
            self.lines.append((rank, stream, text))

    mine = Mine()
    deliver(mine, Live(0, "stderr", "bar 10%", False))
    deliver(mine, Display(0, HTML_BUNDLE, {}, {}))
    deliver(mine, Live(0, "stderr", "bar 100%", True))
    assert mine.lines == [(0, "stderr", "bar 100%")]


def test_a_subclass_of_ones_own_that_skips_init_still_shows_rank_output():
    class Recorder(QuietDisplay):
        def __init__(self):  # no super().__init__()
            self.lines, self.notes = [], []

        def output(self, rank, stream, text):
            self.lines.append((rank, stream, text))

        def note(self, text):
            self.notes.append(text)

    display = Recorder()
    display.start(RunState("t", [0, 1]))
    display.live(0, "stderr", "bar 100%", True)
    display.rich(Display(0, HTML_BUNDLE, {}, {}))
    display.rich(Display(1, HTML_BUNDLE, {}, {}))
    display.finish(None, True)
    assert display.lines == [(0, "stderr", "bar 100%"), (0, "stdout", HTML_BUNDLE["text/plain"])]
    assert display.notes[0].startswith("rank 1 displayed 1 rich output")
