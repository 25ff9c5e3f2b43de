"""Many runs, one slot machinery: work handed to free device slots.

A slot is a set of devices one unit of work runs on: one device for a one-process run, or k
devices for a normal launch on k ranks (DDP, FSDP). `plan_slots` packs slots onto the devices
given (8 GPUs: 8 slots of one, or 4 of two; on CPU, N slots of CPU processes). `SlotRunner`
runs a thread per slot; each takes work until there is none and runs it as a `launch` on its
slot's devices, so every run gets its own world (its own processes and rendezvous, and on GPU its
own CUDA_VISIBLE_DEVICES). The caller's thread, the kernel's main thread, keeps Ctrl-C: it draws,
and on an interrupt stops every slot's launch through that launch's display (`SlotDisplay`),
which the launch's supervisor takes as the notebook's own Ctrl-C, so each slot ends as a
launch ends: its processes stopped, nothing left. `sweep` and `map` are the two front ends (a
sweep's one-device slots keep a live rank each and call it per trial: `sweep_workers.py`).

Slot launches start their ranks from the warm template (a clean process that forks them), never
by forking the kernel from a slot's thread: a fork while another thread holds a lock (an
import's, a stream's) can leave the child waiting on it forever. Starts take turns (one at a
time, each done once its launch is watched); the runs themselves overlap.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from ...common.devices import plan_devices
from ...display.vitals import VitalsSampler
from ...placements import template_process
from ...placements.template_process import template, warm_up
from ..run.choices import choose
from ..run.options import RunOptions, check_count

log = logging.getLogger(__name__)

TICK = 0.1  # seconds between the main thread's looks at the slots (and redraws)


@dataclass(frozen=True)
class Slot:
    index: int
    accelerator: str  # "gpu" or "cpu"
    devices: tuple[int, ...]  # GPU indices as the kernel sees them; () on CPU and on a cluster
    size: int  # how many devices (ranks) a run in this slot has
    threads: int = 0  # torch threads for each of its ranks: its share of the cores (0: as a launch sets them)
    cores: tuple[int, ...] = ()  # the CPUs its processes run on, where slots do not outnumber them; (): any
    sharing: int = 1  # slots on its one GPU (trials_per_device)

    @property
    def launch_devices(self):
        """What `launch(devices=...)` takes for this slot: its GPUs, or how many devices."""
        return list(self.devices) if self.devices else self.size

    def __str__(self) -> str:
        if self.devices:
            shared = f" (slot {self.index})" if self.sharing > 1 else ""
            return f"GPU{'s' if self.size > 1 else ''} {','.join(map(str, self.devices))}{shared}"
        kind = "CPU slot" if self.accelerator == "cpu" else "slot"
        return f"{kind} {self.index}" + (f" ({self.size} ranks)" if self.size > 1 else "")


def plan_slots(devices="auto", per_slot: int = 1, accelerator: str = "auto",
               per_slot_name: str = "devices_per_trial", per_device: int = 1) -> tuple[list[Slot], str | None]:
    """The slots packed onto `devices` (launch's grammar; on CPU a number of CPU processes), and
    a note when some devices are left over. `per_device` > 1: that many one-GPU slots on each GPU
    (small trials that would leave most of a GPU idle)."""
    check_count(per_slot, per_slot_name)
    check_count(per_device, "trials_per_device")
    plan = plan_devices(devices, accelerator)
    if per_device > 1 and plan.accelerator != "gpu":
        raise ValueError(f"trials_per_device={per_device}: several trials share a GPU, and these are CPU processes; "
                         "on CPU, give devices= the number of trials to run at once.")
    if per_device > 1 and per_slot > 1:
        raise ValueError(f"trials_per_device={per_device} with {per_slot_name}={per_slot}: trials that share a GPU "
                         f"have one GPU each; give {per_slot_name}=1.")
    count = plan.nprocs // per_slot
    if count == 0:
        kind = "GPUs" if plan.accelerator == "gpu" else "CPU processes"
        raise ValueError(f"{per_slot_name}={per_slot}: more than the {plan.nprocs} {kind} that devices={devices!r} "
                         f"gives; give {per_slot_name} <= {plan.nprocs}, or more devices.")
    threads, cores = share_cores(count * per_device, per_slot)
    if per_device > 1:
        slots = [Slot(i, "gpu", (plan.indices[i // per_device],), 1, threads, cores[i], per_device)
                 for i in range(count * per_device)]
    elif plan.accelerator == "gpu":
        slots = [Slot(i, "gpu", tuple(plan.indices[i * per_slot:(i + 1) * per_slot]), per_slot, threads, cores[i])
                 for i in range(count)]
    else:
        slots = [Slot(i, "cpu", (), per_slot, threads, cores[i]) for i in range(count)]
    idle = list(plan.indices[count * per_slot:])
    note = None
    if idle:
        what = (f"GPU{'s' if len(idle) > 1 else ''} {idle}" if plan.accelerator == "gpu"
                else f"{len(idle)} CPU process(es)")
        note = (f"{what} left idle: {plan.nprocs} devices make {count} slot{'s' if count > 1 else ''} of "
                f"{per_slot}")
    return slots, note


def share_cores(count: int, per_slot: int) -> tuple[int, list[tuple[int, ...]]]:
    """Each of `count` slots' share of this process's CPUs, as a launch gives each of its ranks its
    share: (threads per rank, each slot's CPUs). Slots that run side by side then never ask for
    more threads than there are cores (2 trials of 2 threads on 2 cores took 6-10x as long as
    trials of 1). A slot gets CPUs of its own only where there are at least as many as slots."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
    threads = max(1, len(cpus) // (count * per_slot))
    if count > len(cpus) or count == 1:
        return threads, [()] * count
    width = len(cpus) // count
    return threads, [tuple(cpus[i * width:(i + 1) * width]) for i in range(count)]


def slot_start(options: RunOptions) -> tuple[str, str]:
    """(strategy, start) for a launch in a slot, from the run options the front end built (their
    words checked there), as `choices.choose`'s "slot" resolves them: ranks from the template,
    'fsdp' under torchrun by default (it starts its ranks by exec); never a fork of this kernel."""
    asked = options.asked
    choice = choose(asked, None, "slot")
    asked.say()
    return choice.strategy, choice.start


class SlotRunner:
    """A thread per slot, each calling `work(slot)` until it returns False (no more work for it).

    `run(tick)` waits on the caller's thread, calling `tick()` about every TICK s (for drawing);
    a Ctrl-C there, or `stop()` from anywhere, ends every slot's running launch (its display
    raises KeyboardInterrupt in its supervisor) and waits until every thread has ended. An error
    escaping `work` (the front end's own, not a run's failure, which `work` records) stops the
    others and is raised by `run`.
    """

    def __init__(self, slots: list[Slot], work: Callable[[Slot], bool], warm: bool = True, preload: tuple = ()):
        self.slots, self.work, self.warm, self.preload = slots, work, warm, preload
        self.stopping = threading.Event()
        self.changed = threading.Event()  # a slot finished something: the main thread looks now
        self.errors: list[BaseException] = []
        self._turn = threading.Lock()  # one launch starting its processes at a time

    def run(self, tick: Callable[[], None] = lambda: None) -> None:
        if self.warm:  # slot launches on this machine start their ranks from it
            _warm_template(self.preload)
        threads = [threading.Thread(target=self._serve, args=(slot,), name=f"nbtrain-slot-{slot.index}", daemon=True)
                   for slot in self.slots]
        for thread in threads:
            thread.start()
        try:
            while any(t.is_alive() for t in threads):
                self.changed.wait(TICK)
                self.changed.clear()
                tick()
        except BaseException:  # Ctrl-C, or the front end's tick failing: nothing may stay running
            self.stop()
            self._wait(threads, tick)
            raise
        tick()
        if self.errors:
            raise self.errors[0]

    def stop(self) -> None:
        self.stopping.set()

    def _wait(self, threads: list[threading.Thread], tick) -> None:
        """Until every slot's launch has stopped its processes (a second Ctrl-C does not cut this
        short: each launch's stop is bounded, by SIGKILL after a grace)."""
        while any(t.is_alive() for t in threads):
            try:
                for thread in threads:
                    thread.join(TICK)
                tick()
            except KeyboardInterrupt:
                log.warning("nbtrain: still stopping the slots' runs; they end within seconds")
            except Exception:  # drawing must not keep processes alive
                log.debug("tick while stopping", exc_info=True)

    def _serve(self, slot: Slot) -> None:
        try:
            while not self.stopping.is_set() and self.work(slot):
                self.changed.set()
        except KeyboardInterrupt:
            pass  # stopped: the main thread knows why
        except BaseException as exc:
            if not self.stopping.is_set():
                self.errors.append(exc)
                self.stopping.set()
        finally:
            self.changed.set()

    def display(self, on_update=None, on_output=None, on_note=None, starts: bool = True) -> SlotDisplay:
        """A display for one launch in a slot (pass it as `progress=`), taking the start turn:
        call it just before `launch`, and `.release()` it after (in a finally). `starts=False`:
        a call on a slot's live rank, which starts no process and takes no turn."""
        return SlotDisplay(self, on_update, on_output, on_note, starts)


class SlotDisplay:
    """A slot launch's display: what the launch reports goes to the front end's callbacks
    (`on_update(state, final)` may raise to end the launch: a pruned trial), and the runner's stop
    becomes a KeyboardInterrupt in the launch's supervisor, handled as the notebook's Ctrl-C."""

    def __init__(self, runner: SlotRunner, on_update, on_output, on_note, starts: bool = True):
        self.runner = runner
        self._on_update, self._on_output, self._on_note = on_update, on_output, on_note
        self.state = None
        self.vitals = VitalsSampler()  # each run's memory, as a launch's own display samples it (Result.vitals)
        if starts:
            runner._turn.acquire()
        self._holding = starts
        if runner.stopping.is_set():  # stopped while waiting for its turn: start nothing
            self.release()
            raise KeyboardInterrupt

    def release(self) -> None:
        """End this launch's start turn (once its ranks are started and watched)."""
        if self._holding:
            self._holding = False
            self.runner._turn.release()

    def start(self, state) -> None:
        self.state = state

    def note(self, text: str) -> None:
        if self._on_note is not None:
            self._on_note(text)

    def output(self, rank, stream: str, text: str) -> None:
        if self._on_output is not None:
            self._on_output(rank, stream, text)

    def update(self, state) -> None:
        self.release()  # the supervisor watches it: its processes are started
        if self.runner.stopping.is_set():
            raise KeyboardInterrupt
        self.vitals.maybe_sample(state)
        if self._on_update is not None:
            self._on_update(state, False)

    def finish(self, state, ok: bool) -> None:
        self.release()
        if self._on_update is not None and state is not None:
            try:
                self._on_update(state, True)  # the last metrics, which may have come with the result
            except Exception:
                pass


def _warm_template(preload: tuple = ()) -> None:
    """Start the warm template from the main thread (its life tied to the kernel's, not to a slot's
    thread); where it cannot start, each launch says so and spawns instead. `preload`: packages
    every run imports (a sweep's trials, Optuna: 1.4 s each, in a fork of a template without it),
    added to the template's list once (a template started without them is replaced; the ranks it
    forked stay)."""
    try:
        missing = [name for name in preload if name not in template_process._preload]
        if missing:
            warm_up(preload=[*template_process._preload, *missing])
        template()
    except Exception as exc:
        log.debug("the warm template did not start: %s", exc)
