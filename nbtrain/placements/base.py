"""What every placement shares: the job, the ranks' environment, and the process handle.

A placement only starts rank processes; which one runs is the strategy's decision
(`nbtrain.notebook.run.launch`), and the processes, the channel and the commands are the pool's
(`nbtrain.notebook.run.pool`), which the notebook side builds around a placement.
"""
from __future__ import annotations

import os
import random
import re
import shutil
import signal
import socket
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from ..common import protocol
from ..common.devices import DevicePlan
from ..common.leftovers import remove_orphans
from ..common.preflight import nccl_environ
from ..common.tensor_files import SHM_DIR
from ..rank.rendezvous import STORE_VAR

_STORE_DIR = re.compile(r"nbtrain-store-(\d+)-\w+")  # a PrivateStore's, named for its kernel


@dataclass(frozen=True)
class Job:
    """What `launch` asked for, never changed after: a placement's `prepare` returns the job as its
    ranks get it (their first command, the rendezvous, the launcher's settings) as a new Job."""
    fn: Callable
    args: tuple
    kwargs: dict
    plan: DevicePlan
    strategy: str
    timeout: float | None = None
    stall: float | bool | None = None  # seconds without progress before the doctor says so (None: its default)
    start_timeout: float = 120.0  # a rank that never reports in is a stall, not a slow start
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    options: dict[str, Any] = field(default_factory=dict)  # launcher-specific settings
    first: object = None  # the ranks' first command (`protocol`): a launch's Run, live ranks' Start
    live: bool = False  # live ranks serve commands until stopped; a launch's ranks exit after the first
    start: str = ""  # where the ranks come from, in launch's words (fork, template, spawn, torchrun, slurm, ray)

    @property
    def ranks(self) -> list[int]:
        first = self.node_rank * self.plan.nprocs
        return list(range(first, first + self.plan.nprocs))

    def with_options(self, **options) -> Job:
        return replace(self, options={**self.options, **options})


_LOWEST_DRAWN, _DRAWS = 10000, 50  # below 10000 lie the well-known services' ports


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now, for a process we start to bind a moment later.

    Drawn below the kernel's ephemeral range: a port the kernel handed out (bind to 0) is one it
    may hand to any outgoing connection before our process binds it (a CI run's torchrun store
    failed on EADDRINUSE so); a port outside that range is taken only by whoever names it.
    """
    below = range(_LOWEST_DRAWN, ephemeral_start())
    for port in random.sample(below, min(_DRAWS, len(below))):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return port
    with socket.socket() as s:  # no range below (an unusual port range): the kernel's pick
        s.bind((host, 0))
        return s.getsockname()[1]


def ephemeral_start() -> int:
    """The lowest port the kernel hands to outgoing connections and to bind(0)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768  # Linux's default; macOS's starts at 49152, above it


class PrivateStore:
    """Where the ranks of a launch on this machine meet: a new directory only this user can enter.

    Each rank's env:// opens a torch FileStore in it (`nbtrain.rank.rendezvous`), so nothing
    listens: another account on the machine can neither read the ranks' keys nor set any. In
    /dev/shm (memory) where there is one. Removed when the launch ends; a killed kernel's, by the
    next launch.
    """

    def __init__(self):
        root = next((r for r in (SHM_DIR, tempfile.gettempdir()) if os.path.isdir(r) and os.access(r, os.W_OK)),
                    tempfile.gettempdir())
        remove_orphans(root, _STORE_DIR, lambda path: shutil.rmtree(path, ignore_errors=True))
        self.path = tempfile.mkdtemp(prefix=f"nbtrain-store-{os.getpid()}-", dir=root)  # a new name, 0700

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)


def rank_environ(job: Job, local_rank: int, channel_env: dict[str, str]) -> dict[str, str]:
    """The torchrun-standard environment for one rank, plus nbtrain's own variables.

    Set only inside the rank: writing MASTER_PORT into the kernel's environment would leak
    into later cells and clash with the next launch.
    """
    plan = job.plan
    env = {
        "RANK": str(job.node_rank * plan.nprocs + local_rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(plan.world_size),
        "LOCAL_WORLD_SIZE": str(plan.nprocs),
        "GROUP_RANK": str(job.node_rank),
        "NODE_RANK": str(job.node_rank),
        "ROLE_RANK": str(job.node_rank * plan.nprocs + local_rank),
        "MASTER_ADDR": job.master_addr,
        "MASTER_PORT": str(job.master_port),
        # The rest of what torchrun gives its workers: libraries read them to see that the
        # processes were started for them (Lightning's TorchElasticEnvironment: RUN_ID).
        "GROUP_WORLD_SIZE": str(plan.num_nodes),
        "ROLE_WORLD_SIZE": str(plan.world_size),
        "ROLE_NAME": "default",
        "TORCHELASTIC_RUN_ID": f"nbtrain-{job.master_port}",
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        **_private_rendezvous(job),
        "NBTRAIN_ACCELERATOR": plan.accelerator,
        "NBTRAIN_BACKEND": plan.backend,
        "NBTRAIN_STRATEGY": job.strategy,
        **job.options.get("quirk_env", {}),  # NCCL workarounds for this machine (preflight)
        **channel_env,
    }
    if plan.accelerator == "gpu":
        env["CUDA_VISIBLE_DEVICES"] = plan.cuda_visible_devices
        env["CUDA_DEVICE_ORDER"] = "PCI_BUS_ID"
    else:  # what `accelerate launch --cpu` sets: Accelerate and Transformers then run on CPU, distributed
        env["ACCELERATE_USE_CPU"] = "true"
    return env


def _private_rendezvous(job: Job) -> dict[str, str]:
    """Ranks all on this machine: their store is private, and gloo's own connections stay on
    loopback (by default gloo listens on the address the host name resolves to, often the LAN's)."""
    if not job.options.get("store"):
        return {}
    return {STORE_VAR: job.options["store"], "GLOO_SOCKET_IFNAME": os.environ.get("GLOO_SOCKET_IFNAME", "lo")}


def describe_exit(code: int, pid: int | None) -> str:
    who = f" (PID {pid})" if pid else ""
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = "unknown"
        hint = " — killed, often by the out-of-memory killer" if name == "SIGKILL" else ""
        return f"Signal {-code} ({name}) received by PID {pid}{hint}"
    if code == 0:
        return f"exited before reporting a result{who}"
    return f"exited with code {code}{who}"


class RankProcess:
    """One OS process carrying some ranks, in a process group of its own.

    The group lets a stop reach what the rank started (DataLoader workers, torchrun's ranks).
    """

    def __init__(self, ranks: list[int], pid: int, poll: Callable[[], int | None],
                 join: Callable[[float], None], close: Callable[[], None] = lambda: None):
        self.ranks = ranks
        self.pid = pid
        self._poll, self._join, self._close = poll, join, close
        self.exited_at: float | None = None

    def poll(self) -> int | None:
        return self._poll()

    def signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
            return
        except (ProcessLookupError, PermissionError):
            pass
        if self.poll() is None:  # not yet its own group leader; never signal a reaped (reusable) pid
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def join(self, timeout: float) -> None:
        self._join(timeout)

    def exit_reason(self, rank: int, code: int, pid: int | None) -> tuple[str, bool]:
        """Why `rank` ended without a report, and whether it crashed (rather than being stopped
        because another rank failed). One process per rank: its own exit says it all."""
        return describe_exit(code, pid), True

    def engine_gone(self) -> str | None:
        """Why the engine that runs these ranks went away under them (Ray shut down), or None."""
        return None

    def lost_reason(self, rank: int) -> str | None:
        """How `rank` ended, when its connection closed but the engine has no exit code for it
        yet (a SLURM task of a job that still runs); None when not known."""
        return None

    def status(self) -> tuple[str, bool] | None:
        """(a new line on where an engine holds this process, or "", whether it waits there), or None.

        Engines that queue ranks (SLURM) say so here: each line is shown once, as it comes, and
        while the process waits the start clock and `timeout` stand still. Called every tick:
        keep it cheap.
        """
        return None

    def close(self) -> None:
        self._close()


class ProcessLauncher:
    """Starts a job's ranks as processes and closes what it opened for them, as torch elastic's
    `PContext` does: `prepare` (checks, shipping, rendezvous: the job as the ranks get it), then
    `start_ranks`, and `close` (after a failed start too). Variants implement `_prepare`, `_start`
    and `_cleanup`."""

    start = ""  # the start= word that names this placement (a cluster's is its engine's name)
    local = False  # every rank on this machine: they meet in a PrivateStore this launcher makes
    _store: PrivateStore | None = None
    _say: Callable[[str], None] = print
    _adopt: Callable[[socket.socket], None]

    def prepare(self, job: Job, live: bool, display, adopt) -> Job:
        """Everything before the first process starts, as the job the ranks get: the launcher's
        own checks and shipping, the ranks' first command (a launch's run, live ranks' start-up),
        the GPU quirks' environment, the rendezvous and torch's port. `display.note` is told what
        the user should know while starting; `adopt` serves a channel made before a rank started."""
        self._say, self._adopt = display.note, adopt
        job = self._prepare(replace(job, live=live))
        first = protocol.Start(0, True) if live else protocol.Run(0, True, self._first_job(job))
        job = replace(job, first=first).with_options(quirk_env=self._quirk_env(job, display))
        if self.local:
            self._store = PrivateStore()
            job = job.with_options(store=self._store.path)
        # Torch's variables, for libraries that read them: nothing of nbtrain's listens there.
        return replace(job, master_port=job.master_port or free_port())

    def start_ranks(self, job: Job, channel_env: dict[str, str], pump, started: list[RankProcess]) -> None:
        """Start the prepared job's ranks, appending each process to `started` as soon as it runs."""
        self._start(job, channel_env, pump, started)

    def close(self, job: Job) -> None:
        """Undo what `prepare` and `start_ranks` left (the processes are the caller's to stop first)."""
        try:
            self._cleanup(job)
        finally:
            if self._store is not None:
                self._store.close()
                self._store = None

    def _start(self, job: Job, channel_env: dict[str, str], pump, started: list[RankProcess]) -> None:
        """Start the ranks, appending each process to `started` as soon as it runs
        (so a failure half-way still stops what did start)."""
        raise NotImplementedError

    def _prepare(self, job: Job) -> Job:
        """Checks and shipping that must succeed before any process starts: the job with what they add."""
        return job

    remote = False  # ranks on other machines: stacks are asked for over the channel, not by signal

    def channel_options(self, job: Job) -> dict:
        """Where the notebook's channel listens (loopback unless ranks run elsewhere)."""
        return {}

    def note(self, text: str) -> None:
        """Tell the user something while starting (the display given to `prepare`)."""
        self._say(text)

    def adopt(self, sock: socket.socket) -> None:
        """Serve a connection made for a rank before it started (the channel's `Hub.adopt`, given
        to `prepare`); launchers whose ranks dial the channel never call it."""
        self._adopt(sock)

    def _first_job(self, job: Job):
        """How the function travels to the ranks: in memory (fork) or as a payload (the others)."""
        return job.options.get("payload")  # script mode: the ranks read it from their job directory

    def _cleanup(self, job: Job) -> None:
        """Undo what `_prepare`/`_start` left behind (temp files, helper processes)."""

    def _quirk_env(self, job: Job, display) -> dict:
        env, note = nccl_environ(job.plan)
        if note:
            display.note(note)
        return env
