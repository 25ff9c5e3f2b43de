"""Each rank's vital signs, sampled in the notebook: step rate, memory, GPU utilisation.

GPU figures come from NVML through the inventory (never torch: that would create a CUDA
context in the kernel and rule out forking), matched to a rank by its process id; resident
memory from psutil. Sampling is at most once per `INTERVAL`, so it costs the training
loop nothing measurable.
"""
from __future__ import annotations

import logging
import os
import time

import psutil

from ..common import inventory
from ..common.protocol import Vital

log = logging.getLogger(__name__)

INTERVAL = 1.0  # seconds between samples
RATE_WINDOW = 5.0  # seconds of step counts behind the live step rate
STRAGGLER = 0.9  # a rank slower than this share of the fastest is marked as the slowest


def _rss(pid: int) -> int | None:
    try:
        return psutil.Process(pid).memory_info().rss
    except psutil.Error:  # the process just exited
        return None


def _gpu_use(pids: set[int]) -> dict[int, tuple[int, int | None, int | None]]:
    """pid -> (physical GPU index, its memory on that GPU, the GPU's utilisation) via NVML."""
    found: dict[int, tuple[int, int | None, int | None]] = {}
    try:
        gpus = inventory._default.physical_gpus()
    except Exception as exc:  # an NVML hiccup: no GPU figures this time
        log.debug("NVML read failed: %s", exc)
        return found
    for gpu in gpus:
        for proc in gpu.processes:
            if proc.pid in pids:
                found[proc.pid] = (gpu.physical_index, proc.memory, gpu.utilization)
    return found


class VitalsSampler:
    """Samples every rank of a run into `state.vitals`; call `maybe_sample` as often as you like."""

    def __init__(self, interval: float = INTERVAL):
        self.interval = interval
        self._last = float("-inf")
        self._sampled: set[int] = set()  # ranks sampled at least once

    def maybe_sample(self, state, now: float | None = None) -> bool:
        """Sample the running ranks into `state` (`notebook/runmodel.RunState.add_vital`) if due."""
        now = time.monotonic() if now is None else now
        due = now - self._last >= self.interval
        if not due and len(self._sampled) == len(state.ranks):
            return False
        # A running rank without a pid runs in this kernel (single device, DataParallel). Each
        # rank is sampled as soon as it runs, then with the others once per interval.
        pids = {r: view.pid or os.getpid() for r, view in state.ranks.items()
                if view.status == "running" and (due or r not in self._sampled)}
        if not pids:
            return False
        if due:
            self._last = now
        gpu = _gpu_use(set(pids.values()))
        at = now - state.started
        for rank, pid in pids.items():
            index, gpu_memory, util = gpu.get(pid, (None, None, None))
            state.add_vital(Vital(round(at, 3), rank, self._rate(rank, state.ranks[rank], now),
                                  _rss(pid), gpu_memory, util, index))
        return True

    def _rate(self, rank: int, view, now: float) -> float | None:
        """Steps/s over the rank's last RATE_WINDOW seconds, by its own clock (see RankView.recent_rate)."""
        self._sampled.add(rank)
        return view.recent_rate(RATE_WINDOW, now)


def latest(state) -> dict[int, Vital]:
    """Each rank's most recent sample."""
    found: dict[int, Vital] = {}
    for vital in reversed(state.vitals):
        if vital.rank not in found:
            found[vital.rank] = vital
            if len(found) == len(state.ranks):
                break
    return found


def slowest(rates: dict[int, float | None]) -> int | None:
    """The rank to mark as the straggler: the slowest, when clearly slower than the fastest."""
    known = {rank: rate for rank, rate in rates.items() if rate is not None}
    if len(known) < 2:
        return None
    rank = min(known, key=known.__getitem__)
    return rank if known[rank] < STRAGGLER * max(known.values()) else None


def memory_text(vital: Vital | None) -> str:
    if vital is None:
        return ""
    if vital.gpu_memory is not None or vital.gpu_util is not None:
        parts = [f"GPU {vital.gpu}"]
        if vital.gpu_memory is not None:
            parts.append(f"{vital.gpu_memory / 2**30:.1f} GiB")
        if vital.gpu_util is not None:
            parts.append(f"{vital.gpu_util}%")
        return " ".join(parts)
    return f"RSS {_bytes(vital.rss)}" if vital.rss else ""  # 0: the process is gone, nothing to say


def _bytes(n: int) -> str:
    return f"{n / 2**30:.1f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


def rate_text(rate: float | None, view=None) -> str:
    """"12.3 it/s"; for a running rank that has not finished a step yet, "first step..." rather
    than a rate of 0 (script mode and Ray ranks take seconds to import and meet)."""
    if view is not None and view.status == "running" and view.bars and not view.steps:
        return "first step..."
    return "" if rate is None else f"{rate:.3g} it/s"
