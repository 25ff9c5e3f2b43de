"""What a launch gives back to the notebook."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...common.protocol import Change, Metric, Vital
from ...display.figure import make_displayable, metrics_figure
from ...display.profile import ProfileTable
from .runmodel import RunState


@dataclass
class Result:
    """What a run gave back: every rank's return value, the logged metrics, and how it ran.

    Returned by `launch` (and a ``%%nbtrain`` cell, as ``_nbtrain_result``), `Ranks.run`,
    ``Run.result()`` and each trial of a `sweep`.

    Parameters
    ----------
    value : object
        Rank 0's return value (a model comes back on the CPU, unwrapped from DDP; a sharded one
        whole).
    values : list
        Every rank's return value on this machine, in rank order.
    history : list of Metric
        Every ``ctx.log`` call: ``(step, rank, name, value, synced)`` rows, in order.
    elapsed : float
        Wall time of the run, in seconds.
    strategy : str, default ''
        How models were wrapped: 'single' (one device in the kernel), 'dp', 'ddp', 'fsdp' or
        'deepspeed'.
    effective_batch_size : int, optional
        What one step saw: the loader's batch size times the ranks, as ``ctx.loader`` reported it.
    devices : str, default ''
        The devices, in words ("2 CPU ranks, gloo").
    vitals : list of Vital
        Each rank's step rate and memory, sampled about once a second.
    profile : ProfileTable, optional
        With ``profile=``: a row per rank, the slowest named.
    restarts : list of str
        Why each restart happened (``max_restarts``), in order.
    start : str, default ''
        Where the ranks came from: 'kernel' (no rank processes), 'fork', 'template', 'spawn',
        'torchrun', 'slurm', 'ray'; for a command on live ranks 'live (fork)' and the like.
    step_times : dict
        Each rank's time split, measured on every run: ``StepTimes(rank, batches, total, data,
        collective, recent)`` in seconds (``data``: waiting for ``ctx.loader``'s batches;
        ``collective``: inside torch.distributed's collectives; the rest is compute).
    straggler : str, optional
        A rank that held the others back, in words ("rank 1 is 1.9x slower than the others: 70 %
        of its step waiting for data"); None when none stood out.
    changes : list of Change
        What was steered while the run trained (``launch(..., wait=False)``): ``Change(step,
        what, detail, time)`` rows, in order, each applied at ``step`` on every rank.
    """
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
    start: str = ""  # a class attribute too: a Result pickled by an earlier release reads ""
    step_times: dict = field(default_factory=dict)  # rank: protocol.StepTimes (rank/tally.py)
    straggler: str | None = None  # the doctor's word on a rank that held the others back
    changes: list[Change] = field(default_factory=list)  # steered while it trained: `protocol.Change`

    @classmethod
    def from_state(cls, state: RunState, strategy: str, devices: str, start: str = "") -> Result:
        """The Result of a run whose ranks reported into ``state`` (the launchers make it).

        Parameters
        ----------
        state : RunState
            What the ranks reported.
        strategy : str
            How models were wrapped.
        devices : str
            The devices, in words.
        start : str, default ''
            Where the ranks came from.

        Returns
        -------
        Result
        """
        values = [state.values.get(r) for r in sorted(state.ranks)]
        return cls(values[0] if values else None, values, list(state.history), state.elapsed,
                   strategy, state.effective_batch_size, devices, list(state.vitals),
                   ProfileTable(state.profiles) if state.profiles else None, start=start,
                   step_times=dict(state.step_times), straggler=state.straggler, changes=list(state.changes))

    def metrics(self, name: str, rank: int | None = 0) -> list[float]:
        """The values logged under one name, in order.

        Parameters
        ----------
        name : str
            The name given to ``ctx.log``.
        rank : int or None, default 0
            Whose values: a rank, or None for every rank's (in the order they were logged).

        Returns
        -------
        list of float
            Empty when nothing was logged under `name` (by `rank`).
        """
        return [m.value for m in self.history if m.name == name and (rank is None or m.rank == rank)]

    def plot(self, *names: str):
        """The logged metrics as a figure: a panel per metric, a line per rank (or one for a
        ``sync_dist=True`` mean), losses on a log scale.

        Parameters
        ----------
        *names : str
            The metrics to draw; none given: all of them.

        Returns
        -------
        matplotlib.figure.Figure
            Shown by Jupyter when it is a cell's value.

        Raises
        ------
        ImportError
            matplotlib is not installed (``pip install 'nbtrain[plot]'``).
        """
        fig = metrics_figure(self.history, names, title=f"{self.strategy} on {self.devices}", changes=self.changes)
        make_displayable()
        return fig

    def __repr__(self) -> str:
        batch = f", effective_batch_size={self.effective_batch_size}" if self.effective_batch_size else ""
        start = f", start={self.start!r}" if self.start else ""
        return (f"Result(strategy={self.strategy!r}{start}, devices={self.devices!r}, elapsed={self.elapsed:.2f}s, "
                f"value={type(self.value).__name__}, {len(self.history)} metrics{batch})")
