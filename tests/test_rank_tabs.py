"""Each rank's output, one selector per rank (`display/rank_tabs.py`): what each rank printed, drew
and displayed, as it last drew it, in plain HTML that a saved notebook keeps."""
from nbtrain.common import protocol
from nbtrain.display.rank_tabs import AFTER_LINES, KEEP_LINES, RankTabs


def test_each_rank_gets_its_own_selector_holding_its_outputs_as_last_drawn():
    tabs = RankTabs()
    assert not tabs
    tabs.add(protocol.Display(2, {"text/html": "<b>old</b>"}, {}, {"display_id": "t"}))
    tabs.add(protocol.Display(1, {"text/plain": "a < b"}, {}, {}))
    tabs.add(protocol.Display(2, {"image/png": "iVBOR", "text/plain": "<Figure>"}, {}, {}))
    tabs.add(protocol.UpdateDisplay(2, {"text/html": "<b>new</b>"}, {}, {"display_id": "t"}))
    assert tabs
    assert tabs.html() == (
        '<div class="nbtrain-rank-tabs">'
        "<details><summary>rank 1 (1 output)</summary><div><pre>a &lt; b</pre></div></details>"
        '<details><summary>rank 2 (2 outputs)</summary><div><b>new</b></div>'
        '<div><img src="data:image/png;base64,iVBOR"/></div></details></div>')


def test_a_ranks_clear_output_empties_only_its_own_selector():
    tabs = RankTabs()
    tabs.add(protocol.Display(1, {"text/plain": "one"}, {}, {}))
    tabs.add(protocol.Display(3, {"text/plain": "three"}, {}, {}))
    tabs.add(protocol.ClearOutput(1, False))
    assert "rank 1" not in tabs.html() and "<pre>three</pre>" in tabs.html()
    tabs.add(protocol.ClearOutput(3, True))
    assert not tabs


def test_each_ranks_lines_and_bars_are_kept_in_its_own_selector():
    tabs = RankTabs()
    tabs.line(0, "stdout", "loss 1 < 2")
    tabs.line(1, "stderr", "a warning")
    tabs.bar(1, "stderr", "bar1: 3/10", done=False)
    assert "bar1: 3/10" in tabs.html()  # drawn now
    tabs.bar(1, "stderr", "bar1: 10/10", done=True)  # left as its last line
    assert not tabs  # no rich output the cell did not show
    assert tabs.html() == (
        '<div class="nbtrain-rank-tabs">'
        "<details><summary>rank 0 (1 line)</summary><pre>loss 1 &lt; 2</pre></details>"
        '<details><summary>rank 1 (2 lines)</summary><pre><span style="color:#c62828">a warning</span>\n'
        '<span style="color:#c62828">bar1: 10/10</span></pre></details></div>')


def test_a_ranks_oldest_lines_give_way_and_say_so():
    tabs = RankTabs()
    for i in range(KEEP_LINES + 5):
        tabs.line(2, "stdout", f"line {i}")
    shown = tabs.html()
    assert f"rank 2 ({KEEP_LINES + 5} lines)" in shown and "… 5 earlier lines" in shown
    assert "line 4\n" not in shown and f"line {KEEP_LINES + 4}" in shown


def test_output_worth_tabs_that_came_after_the_last_redraw_still_ends_as_the_summary(capsys):
    few = RankTabs()
    few.line(0, "stdout", "one")
    few.line(1, "stdout", "two")
    assert not few.end(shown_rank=0)  # a glance: the cell's lines say it all
    tabs = RankTabs()
    for i in range(AFTER_LINES + 1):
        tabs.line(i % 2, "stdout", f"line {i}")
    assert tabs.end(shown_rank=0)  # never drawn live (no update came since): shown as it ends
    assert "rank 0 (6 lines), rank 1 (5 lines)" in capsys.readouterr().out  # outside IPython: its text
