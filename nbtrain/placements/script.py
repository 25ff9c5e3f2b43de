"""ddp: the job becomes a script that torchrun (or accelerate / deepspeed) runs on every rank.

The job travels in a private temporary directory (mode 0700, files 0600), removed when the
launch ends however it ends (a killed kernel's, by the next launch): the dill payload and a
bootstrap script that runs `nbtrain.rank.script_main.rank_main`, whose rank body is the same command loop
(`nbtrain.rank.loop.serve`) every placement uses, so results, errors and metrics come home through the
same channel.

Output: each rank points its fds 1 and 2 (C code and faulthandler included) at a pair of
named pipes in that directory, read by the notebook's output pump. Nothing is polled and
nothing is lost when a rank dies, and the rank is known from the pipe, not from parsing
prefixes; torchrun's --tee/--redirects are not used, and its log directory (error files) is
made in that directory too, not left in /tmp. The notebook holds a write end
of every pipe while the launcher runs, so a restarted rank (--max-restarts) can reopen it.

Rendezvous: static (`--rdzv-backend static --node-rank R`), on a free port for one node, at
the given endpoint for several: a node carries ranks R*nproc .. R*nproc+nproc-1, which is
what the notebook's RunState expects. c10d rendezvous would number nodes by arrival. On one
node the ranks' own process group meets in a private file store in that directory
(`nbtrain.rank.rendezvous`); the launcher's TCP store then carries only its own keys.
"""
from __future__ import annotations

import glob
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import replace

from ..common.leftovers import remove_orphans
from ..common.tensor_files import SHM_DIR
from ..common.transfer import pack_job
from ..rank.script_main import PAYLOAD, pipe_name
from .base import Job, ProcessLauncher, RankProcess, describe_exit, rank_environ
from .torchrun_log import LauncherLog

LAUNCHERS = {  # name: (module run with `python -m`, package to install)
    "torchrun": ("torch.distributed.run", "torch"),
    "accelerate": ("accelerate.commands.launch", "accelerate"),
    "deepspeed": ("deepspeed.launcher.runner", "deepspeed"),
}
OPTIONS = ("launcher", "node_rank", "rdzv_endpoint", "max_restarts", "rerun_as")
BOOTSTRAP = "rank.py"
LOG_WAIT = 1.0  # after the launcher exits, how long its last words (the failure report) may take
RENDEZVOUS_WAIT = 600  # seconds a node waits for the others: torchrun's static rendezvous default
_JOB_DIR = re.compile(r"nbtrain-(\d+)-\w+")  # tempfile.mkdtemp's, see job_dir
TORCH_RANK_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "NODE_RANK",
                   "MASTER_ADDR", "MASTER_PORT", "ROLE_RANK", "GROUP_WORLD_SIZE", "ROLE_WORLD_SIZE", "ROLE_NAME",
                   "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS")

# The launcher must not outlive the kernel (its ranks die with it in turn, see `nbtrain.rank.script_main.rank_main`):
# a parent-death signal survives exec, so set it and become the launcher.
_DIE_WITH_KERNEL = (
    "import ctypes, os, signal, sys\n"
    "try:\n"
    "    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG\n"
    "except (OSError, AttributeError):\n"
    "    pass\n"
    "if os.getppid() != int(sys.argv[1]):\n"
    "    sys.exit(1)\n"
    "os.umask(0o077)  # what the launcher writes (torchrun's log directory) is private; ranks get the kernel's back\n"
    "os.execv(sys.executable, [sys.executable, *sys.argv[2:]])\n"
)

_BOOTSTRAP_TEXT = '''\
# One rank of an nbtrain launch (start="torchrun"); written for this launch only, removed after it.
import ctypes, os, signal, sys
parent = os.getppid()
try:  # die with the launcher from here on, not only once torch is imported
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
except (OSError, AttributeError):
    pass
if parent == 1 or os.getppid() != parent:  # the launcher is already gone
    os._exit(1)
os.umask({umask:#o})  # the kernel's: the launcher ran with 0o077
kernel_tmpdir = {tmpdir!r}
if kernel_tmpdir is None:  # the kernel's TMPDIR again: only the launcher's own temp files go in the job dir
    os.environ.pop("TMPDIR", None)
else:
    os.environ["TMPDIR"] = kernel_tmpdir
sys.path[0:1] = {path!r}  # the kernel's import path, not this directory
from nbtrain.rank.script_main import rank_main
rank_main({job_dir!r}, parent)
'''


# -- options --------------------------------------------------------------------------------

def parse_endpoint(endpoint: str) -> tuple[str, int]:
    host, sep, port = str(endpoint).rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"rdzv_endpoint={endpoint!r}: give HOST:PORT, node 0's address and a free port on it "
                         "(the same on every node), e.g. '10.0.0.1:29400'.")
    return host.strip("[]"), int(port)


def script_options(given: dict, num_nodes: int) -> dict:
    """`launcher_options` checked, with defaults filled in."""
    unknown = sorted(set(given) - set(OPTIONS) - {"quirk_env"})
    if unknown:
        raise ValueError(f"launcher_options: {', '.join(map(repr, unknown))} not known. Accepted: "
                         f"{', '.join(map(repr, OPTIONS))}.")
    options = {"launcher": "torchrun", "node_rank": 0, "rdzv_endpoint": None, "max_restarts": 0, "rerun_as": None}
    options.update({k: v for k, v in given.items() if k in OPTIONS and v is not None})
    launcher, node_rank = options["launcher"], options["node_rank"]
    if launcher not in LAUNCHERS:
        raise ValueError(f"launcher={launcher!r} is not known. Accepted: {', '.join(map(repr, LAUNCHERS))}.")
    if type(node_rank) is not int or not 0 <= node_rank < num_nodes:
        raise ValueError(f"node_rank={node_rank!r}: with num_nodes={num_nodes}, give an int from 0 to {num_nodes - 1}.")
    if type(options["max_restarts"]) is not int or options["max_restarts"] < 0:
        raise ValueError(f"max_restarts={options['max_restarts']!r}: give an int >= 0.")
    if num_nodes > 1 and not options["rdzv_endpoint"]:
        raise ValueError(f"num_nodes={num_nodes} needs rdzv_endpoint='HOST:PORT': node 0's address and a free port "
                         "on it, the same on every node.")
    if options["rdzv_endpoint"]:
        parse_endpoint(str(options["rdzv_endpoint"]))
    return options


def check_installed(launcher: str) -> None:
    module, package = LAUNCHERS[launcher]
    if importlib.util.find_spec(package) is None:
        raise ModuleNotFoundError(
            f"launcher={launcher!r} needs the {package!r} package, which is not installed for {sys.executable}. "
            f"Install it with `pip install {package}`, or use launcher='torchrun' (the default).", name=package)


def launcher_command(launcher: str, job: Job, options: dict, script: str) -> list[str]:
    """The launcher's command line for this node (after `python`)."""
    plan, nproc = job.plan, str(job.plan.nprocs)
    addr, port = job.master_addr, str(job.master_port)
    restarts = str(options["max_restarts"])
    if launcher == "torchrun":
        return ["-m", "torch.distributed.run", "--nnodes", str(plan.num_nodes), "--nproc-per-node", nproc,
                "--node-rank", str(job.node_rank), "--rdzv-backend", "static", "--master-addr", addr,
                "--master-port", port, "--max-restarts", restarts, "--monitor-interval", "0.1", script]
    if launcher == "accelerate":
        # --multi_gpu is accelerate's torchrun path, on CPU too (with ACCELERATE_USE_CPU, see
        # launcher_environ); its --cpu path starts one process, or several only through mpirun.
        return ["-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(plan.world_size),
                "--num_machines", str(plan.num_nodes), "--machine_rank", str(job.node_rank),
                "--main_process_ip", addr, "--main_process_port", port, "--rdzv_backend", "static",
                "--max_restarts", restarts, "--monitor_interval", "0.1", script]
    # GPUs by their indices: with --num_gpus DeepSpeed would take the first n, ignoring the plan.
    gpus = (["--include", f"localhost:{plan.cuda_visible_devices}"] if plan.accelerator == "gpu"
            else ["--num_gpus", nproc])
    return ["-m", "deepspeed.launcher.runner", *gpus, "--master_addr", addr, "--master_port", port, script]


def launcher_environ(job: Job, channel_env: dict[str, str], tmpdir: str | None = None) -> dict[str, str]:
    """The kernel's environment plus nbtrain's variables; the launcher sets each rank's own.

    `tmpdir` becomes the launcher's TMPDIR: torchrun makes a `torchelastic_*` log directory
    there on every launch and never removes it, so it goes inside the launch's own directory
    (the ranks get the kernel's TMPDIR back, see the bootstrap).
    """
    env = dict(os.environ)
    if tmpdir is not None:
        env["TMPDIR"] = tmpdir
    for key in TORCH_RANK_VARS:  # a kernel itself started by torchrun
        env.pop(key, None)
    ours = rank_environ(job, 0, channel_env)
    env.update({k: v for k, v in ours.items() if k not in TORCH_RANK_VARS})
    # Ranks on one machine share its cores (torchrun would say so, and pick 1).
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // job.plan.nprocs)))
    if job.plan.accelerator == "cpu":
        env["ACCELERATE_USE_CPU"] = "true"  # an Accelerator in the ranks then stays on CPU, as planned
        env["DS_ACCELERATOR"] = "cpu"  # and DeepSpeed too
    return env


def remove_deepspeed_buffers(addr: str, port: int | None) -> None:
    """DeepSpeed's CPU all-reduce leaves a shared-memory buffer per rank (~70 MB each) named
    after the run's master address and port; nobody else removes them."""
    if port is None:
        return
    for path in glob.glob(os.path.join(SHM_DIR, f"deepspeed_allreduce_buffer_*_{glob.escape(addr)}_{port}_*")):
        try:
            os.unlink(path)
        except OSError:
            pass


def _umask() -> int:
    """This process's umask, read without setting it (os.umask would, for every thread at once)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o077)  # the brief moment it is changed, it is the stricter one
    os.umask(mask)
    return mask


def job_dir() -> str:
    """A private directory (mode 0700) for one launch, named after this process: a launch
    whose kernel was killed cannot remove its own, so each launch removes those of the dead."""
    root = tempfile.gettempdir()
    remove_orphans(root, _JOB_DIR, lambda path: shutil.rmtree(path, ignore_errors=True))
    return tempfile.mkdtemp(prefix=f"nbtrain-{os.getpid()}-")


# -- the notebook side ----------------------------------------------------------------------

class LauncherProcess(RankProcess):
    """The launcher's process, carrying every rank of this node."""

    def __init__(self, popen: subprocess.Popen, ranks: list[int], name: str, log: LauncherLog, holds: list[int]):
        super().__init__(ranks, popen.pid, self._poll_exit, self._wait, self._release)
        self.name = name
        self._popen, self._log, self._holds = popen, log, holds
        self._exit_seen: float | None = None

    def _poll_exit(self) -> int | None:
        code = self._popen.poll()
        if code is None:
            return None
        # Its failure report may still be on the way: an exit counts once it has been read.
        self._exit_seen = self._exit_seen or time.monotonic()
        if not self._log.done.is_set() and time.monotonic() - self._exit_seen < LOG_WAIT:
            return None
        return code

    def _wait(self, timeout: float) -> None:
        try:
            self._popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def _release(self) -> None:
        # Without our write ends, the ranks' pipes reach end of file once the ranks are gone.
        while self._holds:
            os.close(self._holds.pop())
        self._log.close()

    def signal(self, sig: int) -> None:
        self._log.quiet = True  # being stopped: its complaints about that are not news
        super().signal(sig)

    def exit_reason(self, rank: int, code: int, pid: int | None) -> tuple[str, bool]:
        exits, root = self._log.exits, self._log.root
        own = exits.get(rank)
        stopped = own is None or (own[0] == -signal.SIGTERM and rank != root)
        if root is not None and rank != root and stopped:
            return f"stopped by {self.name} after rank {root} failed", False
        if own is not None:
            return describe_exit(*own), True
        if code == 0:
            why = f"rank {rank} ended without reporting a result ({self.name} exited with code 0)"
        else:
            why = f"{self.name} ended before rank {rank} reported a result: {describe_exit(code, self.pid)}"
        tail = "\n".join(line for line in self._log.tail if line.strip())
        return (f"{why}\n--- {self.name}'s last lines ---\n{tail}" if tail else why), True


class ScriptLauncher(ProcessLauncher):
    start = "torchrun"

    def __init__(self):
        self._dir: str | None = None
        self._holds: list[int] = []  # our write ends of the ranks' pipes (shared with the process handle)
        self._loose: list[int] = []  # fds not yet handed over: ours to close if the start fails

    def _prepare(self, job: Job) -> Job:
        self.options = script_options(job.options, job.plan.num_nodes)
        check_installed(self.options["launcher"])
        job = replace(job, node_rank=self.options["node_rank"])
        if self.options["rdzv_endpoint"]:
            address, port = parse_endpoint(self.options["rdzv_endpoint"])
            job = replace(job, master_addr=address, master_port=port)
        if job.plan.num_nodes > 1 and job.start_timeout is not None:
            # Ranks start only once every node has joined; that wait is not a stall.
            job = replace(job, start_timeout=job.start_timeout + RENDEZVOUS_WAIT)
        self._payload = pack_job(job.fn, job.args, job.kwargs)  # an unpicklable job fails here, before anything starts
        self._dir = job_dir()  # removed by _cleanup, which a failed start is followed by
        if job.plan.num_nodes == 1:  # the ranks' env:// meets in here, not at torchrun's TCP store
            job = job.with_options(store=os.path.join(self._dir, "store"))
            os.mkdir(job.options["store"], 0o700)
        return job

    def _start(self, job, channel_env, pump, started) -> None:
        script = self._write_job(job)
        self._rank_pipes(job, pump)
        launcher = self.options["launcher"]
        command = launcher_command(launcher, job, self.options, script)
        if job.plan.num_nodes > 1:
            self._note_other_nodes(job, command)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        self._loose += [out_r, err_r]
        try:
            popen = subprocess.Popen(
                [sys.executable, "-c", _DIE_WITH_KERNEL, str(os.getpid()), *command],
                env=launcher_environ(job, channel_env, self._launcher_tmp()), stdin=subprocess.DEVNULL, stdout=out_w,
                stderr=err_w,
                start_new_session=True)  # its own group: a stop reaches it, the kernel's Ctrl-C does not
        finally:
            os.close(out_w)
            os.close(err_w)
        self._loose.remove(out_r)
        pump.add(out_r, None, "stdout")  # the pump closes it
        self._loose.remove(err_r)
        log = LauncherLog(err_r, pump.put)  # the log closes it
        started.append(LauncherProcess(popen, job.ranks, launcher, log, self._holds))

    @property
    def _job_dir(self) -> str:
        assert self._dir is not None, "the job's directory exists from _prepare to _cleanup"
        return self._dir

    def _launcher_tmp(self) -> str:
        path = os.path.join(self._job_dir, "tmp")
        os.mkdir(path, 0o700)
        return path

    def _write_job(self, job: Job) -> str:
        def private(name: str, data: bytes) -> str:
            path = os.path.join(self._job_dir, name)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with open(fd, "wb") as f:
                f.write(data)
            return path

        private(PAYLOAD, self._payload)
        path = [os.getcwd() if p == "" else p for p in sys.path]
        text = _BOOTSTRAP_TEXT.format(path=path, job_dir=self._dir, tmpdir=os.environ.get("TMPDIR"), umask=_umask())
        return private(BOOTSTRAP, text.encode())

    def _rank_pipes(self, job: Job, pump) -> None:
        """A named pipe per rank and stream: the pump reads it, and we hold a write end."""
        for local, rank in enumerate(job.ranks):
            for stream in ("stdout", "stderr"):
                path = os.path.join(self._job_dir, pipe_name(stream, local))
                os.mkfifo(path, 0o600)
                read = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
                pump.add(read, rank, stream)  # the pump closes it
                self._holds.append(os.open(path, os.O_WRONLY | os.O_NONBLOCK))

    def _note_other_nodes(self, job: Job, command: list[str]) -> None:
        endpoint = f"{job.master_addr}:{job.master_port}"
        self.note(f"node {job.node_rank} of {job.plan.num_nodes} runs: {sys.executable} {' '.join(command)}")
        self.note(f"its ranks start once every node has joined at {endpoint} (waiting up to "
                   f"{RENDEZVOUS_WAIT // 60} minutes)")
        template = self.options["rerun_as"] or (
            f"the same launch(..., strategy='{job.strategy}', start='torchrun', num_nodes={job.plan.num_nodes}, "
            f"launcher_options={{'node_rank': {{node_rank}}, 'rdzv_endpoint': '{endpoint}'}})")
        for other in range(job.plan.num_nodes):
            if other != job.node_rank:
                self.note(f"on node {other}, run: {template.replace('{node_rank}', str(other))}")

    def _cleanup(self, job: Job) -> None:
        for fds in (self._holds, self._loose):
            while fds:
                os.close(fds.pop())
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None
        if getattr(self, "options", {}).get("launcher") == "deepspeed":
            remove_deepspeed_buffers(job.master_addr, job.master_port)
