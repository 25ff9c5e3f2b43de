"""How nbtrain names a set of ranks in what it says, the same in every message."""
from __future__ import annotations

from collections.abc import Iterable


def ranks_words(ranks: Iterable[int]) -> str:
    """'rank 5', 'ranks 1, 2', 'ranks 0-4, 6, 7': runs of three or more as a range."""
    ranks = sorted(ranks)
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    runs: list[list[int]] = []
    for r in ranks:
        if runs and r == runs[-1][-1] + 1:
            runs[-1].append(r)
        else:
            runs.append([r])
    parts = [f"{run[0]}-{run[-1]}" if len(run) >= 3 else ", ".join(map(str, run)) for run in runs]
    return "ranks " + ", ".join(parts)
