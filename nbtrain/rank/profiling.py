"""Per-rank profiles: torch.profiler over a window of steps, a Chrome trace per rank, and a summary.

A step is one iteration of the innermost `ctx.progress` loop (or one `ctx.step()`). Each rank
records its own window, saves `rank{N}.pt.trace.json` (TensorBoard's profiler and ui.perfetto.dev
open it) and sends the notebook a summary: its step time split into communication (collectives,
on any thread), data loading, compute (other operators) and idle (no operator at all: Python,
sleeps, I/O), and its top operators. Time outside operators has no operator to name, so while the
window records, a thread looks at the rank's main thread every few milliseconds and the summary
names the user's own lines where that time went (`StackSampler`). On a CUDA rank it also saves a
memory snapshot for PyTorch's memory viewer (pytorch.org/memory_viz).
"""
from __future__ import annotations

import bisect
import functools
import os
import re
import sys
import threading
import time
from collections import Counter
from dataclasses import dataclass

import torch

from ..common.tracebacks import package_path

COLLECTIVE = re.compile(r"gloo:|nccl:|c10d::|all_?reduce|all_?gather|reduce_?scatter|broadcast|barrier|all_to_all",
                        re.IGNORECASE)
DATA = re.compile(r"DataLoader|_DataLoaderIter")
STEP = re.compile(r"ProfilerStep[#*]\d*")  # one step's span ("ProfilerStep*" as events() names it)
CATEGORIES = ("communication", "data", "compute", "idle")  # a moment in two counts once, for the first
TOP = 5  # operators (and lines of the user's own code) listed per rank
# A look at the main thread's stack costs about 1 us; every 5 ms its cost is lost in a profiled step's
# noise, every 1 ms it read 2-5 % (benchmarks/profile_sampler.py). 5 steps of 20 ms get 20 looks.
SAMPLE_EVERY = 0.005
# torch.profiler keeps every operator of the window in the rank's memory until it ends, then makes
# each a Python object for the summary (measured on 2 CPU ranks, a small DDP model: a window of
# 1,000 steps took 950 MB per rank instead of 260, and 15 s instead of 3.5; 3,000 steps 2.6 GB),
# and a much longer trace no longer opens in a browser.
MAX_STEPS = 100
WHY_MAX = ("The profiler keeps every operator of the window in each rank's memory (1,000 steps of a small DDP "
           "model took 950 MB per rank) and a longer trace no longer opens in a viewer; a few steps show the split.")


@dataclass(frozen=True)
class Profile:
    """What ``launch(fn, profile=nbtrain.Profile(...))`` records on every rank with torch.profiler.

    Each rank writes its trace (for Perfetto or TensorBoard) under the run directory; the
    summary, the ranks side by side with the slowest named, is ``Result.profile``.
    ``profile=True`` is this with its defaults. A step is one ``ctx.step()`` call, or else one
    iteration of the innermost ``ctx.progress`` loop.

    Parameters
    ----------
    steps : int or range, default 5
        How many steps, after two skipped (the first steps set things up), at most 100; or a
        ``range`` of step numbers counted from 0 (``range(100, 105)``).
    activities : list of {'cpu', 'cuda'}, optional
        What to record; default both where the rank has a GPU, else 'cpu'.
    memory : bool, optional
        Operators' memory, and on CUDA a memory snapshot; default on CUDA ranks only.

    Raises
    ------
    ValueError
        A setting is not accepted; said here, where it is written.
    """
    steps: int | range = 5
    activities: tuple[str, ...] | list[str] | None = None
    memory: bool | None = None

    def __post_init__(self):
        steps = self.steps
        if isinstance(steps, bool) or not isinstance(steps, (int, range)):
            raise ValueError(f"Profile(steps={steps!r}): give a number of steps (1 to {MAX_STEPS}) or a range of "
                             "step numbers such as range(2, 7).")
        window = self.window
        if len(window) < 1 or window.step != 1 or window.start < 0:
            raise ValueError(f"Profile(steps={steps!r}): give a number of steps (1 to {MAX_STEPS}) or a range of "
                             "step numbers such as range(2, 7).")
        if len(window) > MAX_STEPS:
            raise ValueError(f"Profile(steps={steps!r}): at most {MAX_STEPS} steps. {WHY_MAX} Profile a later window "
                             f"with steps=range(start, start + {MAX_STEPS}), or several runs.")
        given = self.activities
        if given is not None and (isinstance(given, str) or not isinstance(given, (list, tuple))
                                  or not given or not all(isinstance(a, str) for a in given)):
            raise ValueError(f"Profile(activities={given!r}): give a list of activities, such as ['cpu'] or "
                             "['cpu', 'cuda'] (None: both where the rank has a GPU).")
        unknown = set(given or ()) - {"cpu", "cuda"}
        if unknown:
            raise ValueError(f"Profile(activities={given!r}): {sorted(unknown)} not known. Accepted: 'cpu', 'cuda'.")
        if self.memory is not None and not isinstance(self.memory, bool):
            raise ValueError(f"Profile(memory={self.memory!r}): give True, False or None (None: on CUDA ranks only).")

    @classmethod
    def check(cls, profile) -> Profile | None:
        """``profile=`` as given to `launch`, as a Profile (None: no profile).

        Parameters
        ----------
        profile : bool, Profile or None
            True: a Profile with its defaults; False or None: none.

        Returns
        -------
        Profile or None

        Raises
        ------
        ValueError
            ``profile`` is none of these.
        """
        if profile is None or profile is False:
            return None
        if profile is True:
            return cls()
        if not isinstance(profile, cls):
            raise ValueError(f"profile={profile!r}: give True, False or nbtrain.Profile(steps=..., activities=..., "
                             "memory=...).")
        return profile

    @property
    def window(self) -> range:
        """The step numbers recorded."""
        return self.steps if isinstance(self.steps, range) else range(2, 2 + self.steps)


class Recorder:
    """One rank's profiler: started with the run, stepped by the Context, stopped at its end."""

    def __init__(self, settings: Profile, rank: int, device: torch.device, out_dir: str):
        self.settings, self.rank, self.out_dir = settings, rank, out_dir
        self.cuda = device.type == "cuda"
        self.memory = self.cuda if settings.memory is None else settings.memory
        names = settings.activities or (("cpu", "cuda") if self.cuda else ("cpu",))
        activities = [getattr(torch.profiler.ProfilerActivity, n.upper()) for n in names]
        window = settings.window
        warmup = 1 if window.start >= 1 else 0
        self.steps = 0
        self.started = False
        self.summary: dict | None = None
        self.sampler = StackSampler(threading.get_ident())
        self.marks: list[int] = []  # when each recorded step began (perf_counter_ns): the samples' clock
        self.trace = os.path.join(out_dir, f"rank{rank}.pt.trace.json")
        self.profiler = torch.profiler.profile(
            activities=activities, profile_memory=self.memory, on_trace_ready=self._ready,
            schedule=torch.profiler.schedule(wait=window.start - warmup, warmup=warmup, active=len(window), repeat=1))

    def start(self) -> None:
        os.makedirs(self.out_dir, exist_ok=True)
        if self.cuda and self.memory:
            torch.cuda.memory._record_memory_history(max_entries=100_000)
        self.sampler.thread_id = threading.get_ident()  # the thread the user's steps run on
        self.profiler.start()
        self.started = True
        self._sample()

    def step(self) -> None:
        self.steps += 1
        if self.steps not in self.settings.window:
            self.sampler.stop()  # before the step that may end the window: its summary reads the samples
        self.profiler.step()
        self._sample()

    def _sample(self) -> None:
        if self.steps in self.settings.window:
            self.marks.append(time.perf_counter_ns())
            self.sampler.start()

    def stop(self) -> dict:
        self.sampler.stop()
        self.profiler.stop()  # a window still open ends here: its trace is saved all the same
        summary = self.summary or {"rank": self.rank, "steps": 0, "trace": None,
                                   "note": f"no step of {_window_words(self.settings.window)} was reached "
                                           f"({self.steps} steps ran)"}
        if self.cuda and self.memory:
            path = os.path.join(self.out_dir, f"rank{self.rank}.memory.pickle")
            torch.cuda.memory._dump_snapshot(path)
            torch.cuda.memory._record_memory_history(enabled=None)
            summary["memory_snapshot"] = path
        return summary

    def _ready(self, profiler) -> None:
        profiler.export_chrome_trace(self.trace)
        self.summary = {"rank": self.rank, "trace": self.trace,
                        **summarize(profiler.events(), self.sampler.samples, self.marks)}


def _window_words(window: range) -> str:
    return f"steps {window.start}-{window.stop - 1}"


def summarize(events, samples=(), marks=()) -> dict:
    """Mean step time and its split into CATEGORIES (seconds per step), the top operators, and
    the user's lines where the time outside operators (idle, data) went: `samples` are the
    main thread's (perf_counter_ns, place) as `StackSampler` saw it, `marks` when each step
    began by the same clock. Time linear in the events (and a sort): a window of 100 steps
    has some 10,000 of them."""
    kind = _kinds()
    steps = [e for e in events if kind(e.name) == "step"]
    if not steps:
        return {"steps": 0}
    main = steps[0].thread
    edges = []  # (time, +1/-1, label)
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        label = kind(e.name)
        if end <= start or label in ("data", "compute") and e.thread != main:
            continue  # only collectives count on other threads (gloo's own)
        edges += [(start, 1, label), (end, -1, label)]
    edges.sort(key=lambda m: (m[0], m[1]))
    seconds = dict.fromkeys(CATEGORIES, 0.0)
    open_ = dict.fromkeys((*CATEGORIES, "step"), 0)
    outside: list[tuple[float, float]] = []  # the main thread's time in no operator (idle) or loading data
    last = None
    for at, change, label in edges:
        if last is not None and at > last and open_["step"]:
            winner = next((c for c in CATEGORIES[:-1] if open_[c]), "idle")
            seconds[winner] += (at - last) / 1e6  # microseconds
            if winner in ("idle", "data"):
                if outside and outside[-1][1] == last:
                    outside[-1] = (outside[-1][0], at)
                else:
                    outside.append((last, at))
        open_[label] += change
        last = at
    n = len(steps)
    per_step = {c: s / n for c, s in seconds.items()}
    windows = [(e.time_range.start, e.time_range.end) for e in steps]
    comm = _top([e for e in events if kind(e.name) == "communication" and not e.name.startswith("c10d::")],
                windows, 1)
    top = _top([e for e in events if kind(e.name) != "step" and e.cpu_parent is not None
                and kind(e.cpu_parent.name) == "step"], windows, TOP)
    # Recorded step i began at marks[i] by the samples' clock and at starts[i] by the profiler's.
    starts = sorted(e.time_range.start for e in steps)
    away = per_step["idle"] + per_step["data"]
    frames = [(*place, share * away) for place, share in
              frames_outside(samples, list(marks)[:len(starts)], starts[:len(marks)], outside)]
    return {"steps": n, "step_time": sum(e.time_range.elapsed_us() for e in steps) / n / 1e6,
            "split": per_step, "top": top, "collective": comm[0][0] if comm else None, "frames": frames}


def frames_outside(samples, marks: list[int], starts: list[float], outside: list[tuple[float, float]],
                   count: int = TOP) -> list[tuple[tuple[str, int, str], float]]:
    """The user's places (file, line, function) the main thread was seen at while in no operator,
    each with its share of the samples taken then (a sample with no user frame counts, for no
    place), most seen first. `samples` are (perf_counter_ns, place or None); step i began at
    `marks[i]` (ns, the samples' clock) and `starts[i]` (us, the profiler's); `outside` are
    the profiler's intervals (us, sorted, disjoint) in no operator."""
    seen: Counter = Counter()
    total = 0
    begins = [a for a, _ in outside]
    for at, place in samples:
        i = bisect.bisect_right(marks, at) - 1  # the step this sample fell in, by the samples' clock
        if i < 0:
            continue  # before the window's first step
        moment = starts[i] + (at - marks[i]) / 1000
        j = bisect.bisect_right(begins, moment) - 1
        if j < 0 or moment >= outside[j][1]:
            continue  # in an operator (or after the window): the operators say where that went
        total += 1
        if place is not None:
            seen[place] += 1
    return [(place, k / total) for place, k in seen.most_common(count)]


@functools.lru_cache(maxsize=4096)
def own_code(path: str) -> bool:
    """Whether `path` is the user's own code: not torch, nbtrain, an installed package or the
    standard library (a notebook cell's file is the user's)."""
    return package_path(path) is None and not path.startswith("<frozen")


def user_place(frame) -> tuple[str, int, str] | None:
    """The innermost frame of the user's own code in a stack (file, line, function), or None."""
    while frame is not None:
        code = frame.f_code
        if own_code(code.co_filename):
            return code.co_filename, frame.f_lineno, code.co_name
        frame = frame.f_back
    return None


class StackSampler:
    """Where one thread is, every SAMPLE_EVERY s while started: the innermost frame of the
    user's own code there (`user_place`), with when it was seen (perf_counter_ns). It reads the
    thread's frame from another thread (`sys._current_frames`), so the sampled thread runs on:
    no signal interrupts it, no tracing slows its every call."""

    def __init__(self, thread_id: int):
        self.thread_id = thread_id
        self.samples: list[tuple[int, tuple[str, int, str] | None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._run, name="nbtrain-profile-sampler", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY):
            frame = sys._current_frames().get(self.thread_id)
            self.samples.append((time.perf_counter_ns(), user_place(frame)))
            del frame  # a frame kept alive keeps its locals alive


def _kinds():
    """An event's kind by its name ("step", or one of CATEGORIES but idle), each name matched
    once: a window repeats the same few hundred names."""
    known: dict[str, str] = {}

    def kind(name: str) -> str:
        if name not in known:
            known[name] = ("step" if STEP.fullmatch(name) else "communication" if COLLECTIVE.search(name)
                           else "data" if DATA.search(name) else "compute")
        return known[name]

    return kind


def _top(events, windows: list[tuple[float, float]], count: int) -> list[tuple[str, float]]:
    """The operators taking the most time within the steps, as (name, seconds per step). Only
    the part inside a step counts: a collective started before the window (DDP's first
    broadcast, on gloo's thread) is not this window's. The steps follow one another on one
    thread, so an event's steps are found by bisection: time linear in the events, not events
    times steps."""
    windows = sorted(windows)
    starts = [a for a, _ in windows]
    totals: dict[str, float] = {}
    for e in events:
        start, end = e.time_range.start, e.time_range.end
        inside = 0.0
        i = max(bisect.bisect_right(starts, start) - 1, 0)  # the last step that began before this event
        while i < len(windows) and windows[i][0] < end:
            a, b = windows[i]
            inside += max(0.0, min(end, b) - max(start, a))
            i += 1
        if inside > 0:
            totals[e.name] = totals.get(e.name, 0.0) + inside / 1e6
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:count]
    return [(name, seconds / len(windows)) for name, seconds in ranked]
