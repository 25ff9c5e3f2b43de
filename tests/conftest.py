import os
import re
import sys

import psutil
import pytest


@pytest.fixture
def no_leftovers():
    """After the test: no child process, no new open file descriptor, MASTER_PORT not leaked."""
    import nbtrain.placements.template_process

    me = psutil.Process()
    had_template = nbtrain.placements.template_process.template(start=False) is not None
    had_tracker = any(is_resource_tracker(c) for c in me.children())
    fds_before = me.num_fds()
    yield
    if not had_template:  # a template the test started is the kernel's by design: stopping it must leave nothing
        nbtrain.stop_template()
    children = [c for c in me.children(recursive=True)
                if not _is_template(c) and not _is_local_slurm(c) and not is_resource_tracker(c)]
    assert not children, f"processes left behind: {[(c.pid, c.name()) for c in children]}"
    # multiprocess's resource tracker, started by the test's first spawned rank, stays with its pipe
    tracker_fd = not had_tracker and any(is_resource_tracker(c) for c in me.children())
    assert me.num_fds() <= fds_before + tracker_fd, f"file descriptors leaked: {fds_before} -> {me.num_fds()}"
    assert "MASTER_PORT" not in os.environ


def timed_out_in_place(launch, function: str, timeouts: tuple[float, ...]):
    """`launch(timeout)`'s WorkerError, and the timeout it was given, for a run whose ranks hang
    in `function`: `timeout=` counts from the launch, the ranks' own start included (an interpreter
    importing torch each: 2-3 s on a quiet 2-core machine, 20 s under a load of 12), so a short one
    is tried first, and a longer one only if a rank's stack shows it had not reached `function` yet.
    Stacks that never show it fail the test after the last timeout, as they would have after one."""
    from nbtrain import WorkerError

    for timeout in timeouts:
        with pytest.raises(WorkerError) as caught:
            launch(timeout)
        stacks = re.split(r"--- rank \d+ stack.*---", caught.value.traceback)[1:]  # each rank's (and its native one)
        if stacks and all(function in stack for stack in stacks):
            break
    return caught.value, timeout


@pytest.fixture(scope="module")
def one_template():
    """The module's warm template, kept from its first [template] test to the module's end, as a
    notebook keeps it: each is an interpreter importing torch, which `no_leftovers` would
    otherwise stop after every test that started one."""
    yield
    import nbtrain

    nbtrain.stop_template()


@pytest.fixture(autouse=True)
def sigint_as_it_was(request):
    """Each test runs with Ctrl-C raising KeyboardInterrupt, as in a kernel, and ends with SIGINT's
    handler as it began. A suite started in the background by a shell without job control (`bash
    .ci/run &`) inherits SIGINT ignored, and Python then installs no handler: the tests that interrupt
    a launch in this process (test_two_nodes.py) saw SIG_IGN. A test (or a library it runs here:
    Lightning ignores SIGINT after its own KeyboardInterrupt) that changes the handler is named."""
    import signal
    import warnings

    before = signal.getsignal(signal.SIGINT)
    if before is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before and not (before is signal.SIG_IGN and after is signal.default_int_handler):
        warnings.warn(f"{request.node.nodeid} left SIGINT's handler {after!r} (was {before!r}); restored",
                      stacklevel=1)
    signal.signal(signal.SIGINT, before)


@pytest.fixture(autouse=True)
def template_before_the_test(request):
    """For a test that launches from this process on the template (a [template] test, or any in a
    module that sets KEEP_THE_TEMPLATE: submitted runs' supervisors, sweep trials, map workers):
    the module's template, started before `no_leftovers` looks, so its check leaves it running
    (the ranks, and what they started, are still checked)."""
    wants = request.node.name.endswith("[template]") or getattr(request.module, "KEEP_THE_TEMPLATE", False)
    if wants and "no_leftovers" in request.fixturenames:
        import nbtrain

        request.getfixturevalue("one_template")
        nbtrain.warm_up()


def this_workers(process) -> bool:
    """Whether a process of the machine was started under this pytest process (or this xdist worker):
    found by name among the machine's processes (Ray's actors, reparented once their raylet is
    killed), another worker's must not count. Every process started here inherits the variable."""
    try:
        return process.environ().get("PYTEST_XDIST_WORKER") == os.environ.get("PYTEST_XDIST_WORKER")
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def is_resource_tracker(process) -> bool:
    """multiprocess's resource tracker, which a kernel's first spawned rank starts (start='spawn'),
    kept for the kernel's life."""
    try:
        return "from multiprocess.resource_tracker import main" in " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return False


def _is_template(process) -> bool:
    import nbtrain.placements.template_process

    running = nbtrain.placements.template_process.template(start=False)
    return running is not None and process.pid == running.process.pid


# A kernel's children as the kernel tests see them, for their set-up cells: the warm template and
# multiprocess's resource tracker (start='spawn') are the kernel's by design, its ranks are not.
CHILDREN = '''
def children():
    import psutil, nbtrain.placements.template_process
    keep = nbtrain.placements.template_process.template(start=False)
    keep = keep.process.pid if keep else None
    def tracker(c):
        try:
            return "from multiprocess.resource_tracker import main" in " ".join(c.cmdline())
        except psutil.Error:
            return False
    return [c.pid for c in psutil.Process().children(recursive=True) if c.pid != keep and not tracker(c)]
'''


# The small model the kernel tests define as a notebook would, in a set-up cell.
NET = '''\
class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)
    def forward(self, x):
        return self.layer(x)
'''

# A two-layer model and a batch, as a notebook defines them: the strategy tests' magic cells.
TINY = '''
import torch, nbtrain
import torch.nn.functional as F

class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(4, 8)
        self.b = torch.nn.Linear(8, 2)
    def forward(self, x):
        return self.b(torch.relu(self.a(x)))

x, y = torch.randn(16, 4), torch.randint(0, 2, (16,))
'''

def running(pid: int) -> bool:
    """Whether `pid` is a live process (a zombie is not)."""
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def start_kernel(**kwargs):
    """jupyter_client's `start_new_kernel` (kernel `python3`), tried once more if the kernel did not
    come up. jupyter_client picks five free TCP ports and the kernel binds them a moment later;
    under the suite's load another process (a rank's gloo, another worker's kernel) once took one in
    between, and the kernel died at start ("Address already in use"). A second try picks new ports."""
    from jupyter_client.manager import start_new_kernel

    try:
        return start_new_kernel(kernel_name="python3", **kwargs)
    except RuntimeError as error:  # start_new_kernel shut that kernel down before raising
        print(f"the kernel did not start ({error}): starting another", file=sys.stderr)
        return start_new_kernel(kernel_name="python3", **kwargs)


class Kernel:
    """A real Jupyter kernel (the same python as the tests) driven through jupyter_client."""

    def __init__(self):
        self.manager, self.client = start_kernel()

    def run(self, code: str, timeout: float = 120, answers: list[str] | None = None):
        """Execute a cell; return (stdout text, stderr text, error content or None, results).

        `answers`: lines typed at the cell's `input()` prompts (pdb's included), in order;
        the prompts are kept in `self.prompts`.
        """
        out, err, results, error = [], [], [], None
        self.prompts, pending = [], list(answers or [])

        def stdin_hook(msg):
            self.prompts.append(msg["content"]["prompt"])
            self.client.input(pending.pop(0) if pending else "q")

        def hook(msg):
            nonlocal error
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                (out if content["name"] == "stdout" else err).append(content["text"])
            elif kind in ("execute_result", "display_data"):
                results.append(content["data"])
            elif kind == "error":
                error = content

        for _ in range(5):  # a cell ipykernel aborted unrun (just after a failed cell) is sent again
            reply = self.client.execute_interactive(code, timeout=timeout, output_hook=hook,
                                                    allow_stdin=answers is not None, stdin_hook=stdin_hook)
            if reply["content"]["status"] != "aborted":
                break
        return "".join(out), "".join(err), error, results

    def wait_for_output(self, msg_id: str, *texts: str, timeout: float = 60) -> str:
        """Read the output of a cell started with `self.client.execute` (its id: `msg_id`) until
        each of `texts` has been printed: an event to act on, where a sleep would guess."""
        import queue
        import time

        shown, deadline = "", time.monotonic() + timeout
        while not all(text in shown for text in texts):
            left = deadline - time.monotonic()
            try:
                message = self.client.get_iopub_msg(timeout=max(left, 0.01))
            except queue.Empty:
                raise AssertionError(f"not printed within {timeout:g} s: {texts}; printed: {shown!r}") from None
            if message["parent_header"].get("msg_id") == msg_id and message["msg_type"] == "stream":
                shown += message["content"]["text"]
        return shown

    def value(self, expression: str, timeout: float = 120):
        """`expression`'s value in the kernel, read from the execute reply (`user_expressions`, on
        the shell channel): neither a printed line (ipykernel's stdout flush gives up under heavy
        load) nor display data on IOPub (once missing from the cell after an interrupted one)."""
        # A cell of its own, counted as the display cell it replaced was (tests name `Cell In[n]`).
        # A request that reaches ipykernel just after a cell failed (an interrupt included) can be
        # aborted unrun (status "aborted", nothing shown): it is sent again.
        for _ in range(5):
            msg_id = self.client.execute("pass", user_expressions={"v": f"repr(({expression}))"})
            while (reply := self.client.get_shell_msg(timeout=timeout))["parent_header"].get("msg_id") != msg_id:
                pass
            if reply["content"]["status"] != "aborted":
                break
        shown = reply["content"]["user_expressions"]["v"]
        assert shown["status"] == "ok", f"{expression}: {shown.get('ename')}: {shown.get('evalue')}"
        return eval(eval(shown["data"]["text/plain"]))

    def close(self):
        self.client.stop_channels()
        self.manager.shutdown_kernel(now=True)


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    yield k
    k.close()


# -- a one-node SLURM cluster on this machine ---------------------------------------------------

SLURM_PROGRAMS = ("slurmctld", "slurmd", "munged", "sbatch", "squeue", "scancel", "srun", "sinfo")


def slurm_unavailable() -> str | None:
    """Why a local SLURM cluster cannot be started here, or None."""
    import shutil

    missing = [p for p in SLURM_PROGRAMS if shutil.which(p) is None]
    if missing:
        return f"SLURM is not installed here (no {', '.join(missing)}; `apt-get install slurm-wlm munge`)"
    if os.geteuid() != 0:
        return "a local SLURM cluster needs root (slurmd and munged run as root)"
    if not os.access("/etc/munge/munge.key", os.R_OK):
        return "no readable munge key (/etc/munge/munge.key; `apt-get install munge` makes one)"
    return None


class LocalSlurm:
    """A one-node SLURM cluster private to this test session: its own munged (socket in a temp
    dir), its own ports, state, spool and logs; the default partition `debug`. The daemons run
    in the foreground as children of the session and die with it, however it ends."""

    running: set[int] = set()  # the daemons' pids: the session's own, not leftovers of a test

    def __init__(self, root):
        from pathlib import Path

        self.root = Path(root)
        self.conf = self.root / "slurm.conf"
        self.socket = self.root / "munge" / "munge.socket"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self.daemons = []

    def _conf(self) -> str:
        import socket

        def port():
            with socket.socket() as s:
                s.bind(("", 0))
                return s.getsockname()[1]

        host, r = socket.gethostname().split(".")[0], self.root
        return "\n".join([
            f"ClusterName=nbtrain{os.getpid()}", f"SlurmctldHost={host}", "SlurmUser=root", "SlurmdUser=root",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.socket}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "SchedulerType=sched/backfill", "MpiDefault=none", "ReturnToService=2",
            "JobAcctGatherType=jobacct_gather/none", "AccountingStorageType=accounting_storage/none",
            f"SlurmctldPort={port()}", f"SlurmdPort={port()}", f"StateSaveLocation={r}/state",
            f"SlurmdSpoolDir={r}/spool", f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd.log",
            # 8 CPUs declared whatever the machine has (config_overrides: slurmd believes the
            # file), so a job of 8 tasks fits, as on an 8-GPU node; the ranks are cheap.
            "SlurmdParameters=config_overrides",
            f"NodeName={host} CPUs={max(8, os.cpu_count())} State=UNKNOWN",
            f"PartitionName=debug Nodes={host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4", ""])

    def _daemon(self, *command) -> None:
        import ctypes
        import signal
        import subprocess

        def die_with_the_session():
            ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG: survives exec

        process = subprocess.Popen(command, env=self.env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                   stderr=subprocess.DEVNULL, preexec_fn=die_with_the_session)
        self.daemons.append(process)
        LocalSlurm.running.add(process.pid)

    def start(self, timeout: float = 60.0) -> None:
        import subprocess
        import time

        for d in ("state", "spool", "log", "munge"):
            (self.root / d).mkdir(mode=0o700, parents=True, exist_ok=True)
        self.conf.write_text(self._conf())
        m = self.root / "munge"
        self._daemon("munged", "--foreground", "--force", f"--socket={self.socket}", f"--pid-file={m}/munged.pid",
                     f"--log-file={m}/munged.log", f"--seed-file={m}/munged.seed")
        deadline = time.monotonic() + timeout
        while not self.socket.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        self._daemon("slurmctld", "-D", "-f", str(self.conf))
        self._start_nodes()
        while time.monotonic() < deadline:
            state = subprocess.run(["sinfo", "--noheader", "--format", "%t"], env=self.env, capture_output=True,
                                   text=True).stdout.strip()
            if state == "idle":
                return
            time.sleep(0.5)
        logs = "\n".join((self.root / "log" / f).read_text()[-2000:] for f in ("slurmctld.log", "slurmd.log")
                         if (self.root / "log" / f).exists())
        self.stop()
        raise RuntimeError(f"the local SLURM cluster did not become idle within {timeout:g} s:\n{logs}")

    def _start_nodes(self) -> None:
        self._daemon("slurmd", "-D", "-f", str(self.conf))

    def jobs(self) -> list[str]:
        """The ids of jobs still in the queue, in any state."""
        import subprocess

        out = subprocess.run(["squeue", "--noheader", "--format", "%i"], env=self.env, capture_output=True, text=True)
        return out.stdout.split()

    def stop(self) -> None:
        import shutil
        import subprocess

        if self.jobs():
            subprocess.run(["scancel", "--full", *self.jobs()], env=self.env, capture_output=True)
        for process in reversed(self.daemons):  # slurmd, slurmctld, then munged
            process.terminate()
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            LocalSlurm.running.discard(process.pid)
        shutil.rmtree(self.root, ignore_errors=True)


def _is_local_slurm(process) -> bool:
    """One of the session's SLURM daemons, or a process they started (slurmscriptd)."""
    try:
        return any(p.pid in LocalSlurm.running for p in [process, *process.parents()])
    except psutil.NoSuchProcess:
        return False


@pytest.fixture(scope="session")
def local_slurm(tmp_path_factory):
    """The session's SLURM cluster (SLURM_CONF exported, so kernels started later use it), or
    None where it cannot run; see `slurm` for tests that need it."""
    reason = slurm_unavailable()
    if reason is not None:
        yield reason
        return
    import glob
    import shutil
    import tempfile

    for old in glob.glob(os.path.join(tempfile.gettempdir(), "nbtrain-slurm-*-*")):  # of sessions that were killed
        if not psutil.pid_exists(int(os.path.basename(old).split("-")[2])):
            shutil.rmtree(old, ignore_errors=True)
    # Not under pytest's tmp_path: slurmd and munged refuse paths whose parents others may write.
    cluster = LocalSlurm(tempfile.mkdtemp(prefix=f"nbtrain-slurm-{os.getpid()}-"))
    try:
        cluster.start()
    except (OSError, RuntimeError) as exc:
        yield f"the local SLURM cluster did not start: {exc}"
        return
    before = os.environ.get("SLURM_CONF")
    os.environ["SLURM_CONF"] = str(cluster.conf)
    try:
        yield cluster
    finally:
        if before is None:
            os.environ.pop("SLURM_CONF", None)
        else:
            os.environ["SLURM_CONF"] = before
        cluster.stop()


@pytest.fixture
def slurm(local_slurm):
    if isinstance(local_slurm, str):
        pytest.skip(local_slurm)
    return local_slurm


# -- a small file system of a test's own: a full disk, a read-only one ----------------------------

MS_RDONLY, MNT_DETACH = 1, 2


@pytest.fixture
def small_disk(tmp_path):
    """A file system of its own under tmp_path (a tmpfs): `small_disk("256k")`, or `small_disk(read_only=True)`."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    mounted = []

    def mount(size: str = "256k", read_only: bool = False):
        target = tmp_path / f"disk{len(mounted)}"
        target.mkdir()
        if libc.mount(b"tmpfs", str(target).encode(), b"tmpfs", MS_RDONLY if read_only else 0,
                      f"size={size},mode=0700".encode()) != 0:
            pytest.skip(f"cannot mount a small tmpfs here ({os.strerror(ctypes.get_errno())}): needs root")
        mounted.append(target)
        return target

    yield mount
    for target in mounted:
        libc.umount2(str(target).encode(), MNT_DETACH)
