"""The other ranks' rich output (IPython display: HTML, images, tables), one selector per rank.

The cell shows the shown rank's rich output where it is (`rank_output.py`); what every other rank
displayed during the command is kept here and shown once the command ends, under a `<details>`
selector per rank: plain HTML, so it stays in the saved notebook as a static summary and needs no
widget, script or style (a notebook's sanitizer keeps it). A display a rank updated shows its last
state; a rank's `clear_output` empties its selector.
"""
from __future__ import annotations

import html
from collections import defaultdict

from ..common import protocol

IMAGES = ("image/png", "image/jpeg", "image/gif")
_END = "\ufffe"  # a display without an id: never matched by an update


class RankTabs:
    def __init__(self):
        self._outputs: dict[int, list[tuple[str, dict]]] = defaultdict(list)  # rank: (display id, data)

    def __bool__(self) -> bool:
        return any(self._outputs.values())

    def add(self, message) -> None:
        """A rank's `protocol.Display`, `UpdateDisplay` or `ClearOutput`."""
        outputs = self._outputs[message.rank]
        if isinstance(message, protocol.ClearOutput):
            outputs.clear()
            return
        display_id = message.transient.get("display_id", _END)
        if isinstance(message, protocol.UpdateDisplay):
            outputs[:] = [(i, message.data if i == display_id else d) for i, d in outputs]
        else:
            outputs.append((display_id, message.data))

    def html(self) -> str:
        """One `<details>` per rank holding its outputs, in rank order."""
        parts = []
        for rank in sorted(r for r, outputs in self._outputs.items() if outputs):
            outputs = self._outputs[rank]
            body = "".join(f"<div>{_as_html(data)}</div>" for _, data in outputs)
            count = f"{len(outputs)} output{'s' if len(outputs) > 1 else ''}"
            parts.append(f"<details><summary>rank {rank} ({count})</summary>{body}</details>")
        return f'<div class="nbtrain-rank-tabs">{"".join(parts)}</div>'


def _as_html(data: dict) -> str:
    """One output's richest form that HTML holds: its HTML (the rank's code is the user's own), an
    image, else its text."""
    if "text/html" in data:
        return str(data["text/html"])
    for mime in IMAGES:
        if mime in data:
            return f'<img src="data:{mime};base64,{data[mime]}"/>'
    return f"<pre>{html.escape(str(data.get('text/plain', '')))}</pre>"
