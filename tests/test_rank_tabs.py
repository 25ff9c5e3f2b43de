"""The other ranks' rich output, one selector per rank (`display/rank_tabs.py`): what each rank
displayed, as it last drew it, in plain HTML that a saved notebook keeps."""
from nbtrain.common import protocol
from nbtrain.display.rank_tabs import RankTabs


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
