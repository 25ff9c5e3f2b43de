"""What a launch gives back to the notebook."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..display.figure import make_displayable, metrics_figure
from ..display.profile import ProfileTable
from ..common.protocol import Metric, Vital
from .runmodel import RunState


@dataclass
class Result:
    value: Any  # rank 0's return value
    values: list[Any]  # every rank's return value on this node, in rank order
    history: list[Metric]  # logged metrics: step, rank, name, value, synced
    elapsed: float  # wall time of the launch, seconds
    strategy: str = ""
    effective_batch_size: int | None = None
    devices: str = ""  # the plan, in words
    vitals: list[Vital] = field(default_factory=list)  # per-rank step rate and memory, about once a second
    profile: ProfileTable | None = None  # launch(..., profile=...): a row per rank, the slowest named
    restarts: list[str] = field(default_factory=list)  # why each restart of a submitted run's ranks happened

    @classmethod
    def from_state(cls, state: RunState, strategy: str, devices: str) -> "Result":
        values = [state.values.get(r) for r in sorted(state.ranks)]
        return cls(values[0] if values else None, values, list(state.history), state.elapsed,
                   strategy, state.effective_batch_size, devices, list(state.vitals),
                   ProfileTable(state.profiles) if state.profiles else None)

    def metrics(self, name: str, rank: int | None = 0) -> list[float]:
        """The values logged under `name` (by `rank`; None for every rank), in order."""
        return [m.value for m in self.history if m.name == name and (rank is None or m.rank == rank)]

    def plot(self, *names: str):
        """A matplotlib Figure of the logged metrics (all, or those named): a panel per metric, a
        line per rank or the mean over ranks, losses on a log scale. Needs `nbtrain[plot]`."""
        fig = metrics_figure(self.history, names, title=f"{self.strategy} on {self.devices}")
        make_displayable()
        return fig

    def __repr__(self) -> str:
        batch = f", effective_batch_size={self.effective_batch_size}" if self.effective_batch_size else ""
        return (f"Result(strategy={self.strategy!r}, devices={self.devices!r}, elapsed={self.elapsed:.2f}s, "
                f"value={type(self.value).__name__}, {len(self.history)} metrics{batch})")
