"""Two nodes on one machine, for the multi-node tests: two network namespaces, each with its
own address and host name, joined to this machine (the notebook's side, as on a login node)
by a bridge; a SLURM cluster with one `slurmd` in each.

    10.231.N.1  the bridge: this machine, where the kernel and slurmctld run
    10.231.N.11 node 1 (namespace and host name nbt<pid>sn1), reached over a veth pair
    10.231.N.12 node 2 (nbt<pid>sn2)

and the same for Ray in 10.232.N.0/24 (nbt<pid>rn1, nbt<pid>rn2; the Ray head, with no CPUs
of its own, on the bridge beside the kernel).

The nodes' names are in /etc/hosts (marked with this session's pid), so the nodes and this
machine resolve them as a cluster's DNS would; this machine's own host name is left as it is
(on Debian and here it resolves to loopback, which is what the default notebook address must
survive). Every name, address and file is this session's own, and `close` removes them all,
also after a failed start.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import psutil

from conftest import LocalSlurm

HOSTS = "/etc/hosts"
# A starting Ray node's processes run ahead of the other tests' (niceness below 0 needs root, as
# the two nodes do): Ray's fixed 30 s for a raylet to register is otherwise missed under load.
STARTING_NICENESS = -5


def unavailable() -> str | None:
    """Why two nodes cannot be made here, or None."""
    if os.geteuid() != 0:
        return "two nodes on one machine need root (network namespaces, a bridge, /etc/hosts)"
    missing = [p for p in ("ip", "nsenter", "unshare") if shutil.which(p) is None]
    if missing:
        return f"two nodes on one machine need {', '.join(missing)} (iproute2, util-linux)"
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"`ip netns` does not work here: {probe.stderr.strip()}"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


class Network:
    """The bridge, the two namespaces and their /etc/hosts lines."""

    def __init__(self, engine: str = "s"):  # one letter: each engine's tests have a network of their own
        pid = os.getpid()
        self.tag = f"nbt{pid % 100000}{engine}"
        self.subnet = f"10.{231 + 'sr'.index(engine)}.{pid % 100 + 100}"
        self.bridge, self.gateway = f"{self.tag}br", f"{self.subnet}.1"
        self.nodes = {f"{self.tag}n{i}": f"{self.subnet}.{10 + i}" for i in (1, 2)}  # name: address
        self.mark = f"# nbtrain two-node test {pid}{engine}"

    def create(self) -> None:
        remove_orphans()
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("addr", "add", f"{self.gateway}/24", "dev", self.bridge)
            _ip("link", "set", self.bridge, "up")
            for i, (name, address) in enumerate(self.nodes.items(), 1):
                outside, inside = f"{self.tag}v{i}", f"{self.tag}p{i}"
                _ip("netns", "add", name)
                _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
                _ip("link", "set", inside, "netns", name)
                _ip("link", "set", outside, "master", self.bridge)
                _ip("link", "set", outside, "up")
                _ip("-n", name, "addr", "add", f"{address}/24", "dev", inside)
                _ip("-n", name, "link", "set", inside, "up")
                _ip("-n", name, "link", "set", "lo", "up")
            with open(HOSTS, "a") as f:
                f.writelines(f"{address} {name} {self.mark}\n" for name, address in self.nodes.items())
        except subprocess.CalledProcessError as exc:
            self.remove()
            raise RuntimeError(f"could not make two nodes: `{' '.join(exc.cmd)}`: {exc.stderr.strip()}") from None

    def pids(self, node: str) -> list[int]:
        """Every process in a node's network namespace."""
        done = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True)
        return [int(p) for p in done.stdout.split()]

    def run_on(self, node: str, *command: str) -> list[str]:
        """`command` inside a node, as that node's host (its own network and host name)."""
        return ["nsenter", f"--net=/run/netns/{node}", "unshare", "--uts", "sh", "-c",
                f'hostname {node} && exec "$@"', "sh", *command]

    def remove(self) -> None:
        for node in self.nodes:
            for pid in self.pids(node):  # whatever a failed test left in the node: this session's own
                try:
                    psutil.Process(pid).kill()
                except psutil.NoSuchProcess:
                    pass
            subprocess.run(["ip", "netns", "del", node], capture_output=True)  # its veth pair goes with it
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        with open(HOSTS) as f:
            kept = [line for line in f if not line.rstrip().endswith(self.mark)]
        with open(HOSTS, "w") as f:  # rewritten in place: /etc/hosts may be a bind mount
            f.writelines(kept)


def remove_orphans() -> None:
    """What sessions that were killed left (their daemons died with them; the network did not):
    their /etc/hosts lines name their nodes and their pid."""
    import re

    with open(HOSTS) as f:
        lines = f.read().splitlines(keepends=True)
    dead: dict[str, set[str]] = {}  # a dead session's tag: its node names
    for line in lines:
        found = re.fullmatch(r"\S+ (\S+) # nbtrain two-node test (\d+)([a-z])", line.strip())
        if found and not psutil.pid_exists(int(found[2])):
            dead.setdefault(f"nbt{int(found[2]) % 100000}{found[3]}", set()).add(found[1])
    if not dead:
        return
    for tag, nodes in dead.items():
        for node in nodes:
            done = subprocess.run(["ip", "netns", "pids", node], capture_output=True, text=True)
            for pid in map(int, done.stdout.split()):  # a job's processes that outlived their slurmd
                try:
                    psutil.Process(pid).kill()
                except psutil.NoSuchProcess:
                    pass
            subprocess.run(["ip", "netns", "del", node], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{tag}br"], capture_output=True)
    names = {name for nodes in dead.values() for name in nodes}
    with open(HOSTS, "w") as f:
        f.writelines(line for line in lines
                     if not ("# nbtrain two-node test" in line and names & set(line.split())))


class TwoNodeSlurm(LocalSlurm):
    """LocalSlurm with its controller on the bridge and one slurmd in each namespace."""

    def __init__(self, root, network: Network):
        super().__init__(root)
        self.network = network

    def _conf(self) -> str:
        net = self.network
        names = ",".join(net.nodes)
        lines = super()._conf().splitlines()
        host = next(line.split("=", 1)[1] for line in lines if line.startswith("SlurmctldHost="))
        rewritten = {
            "SlurmctldHost": f"SlurmctldHost={host}({net.gateway})",
            "SlurmdSpoolDir": f"SlurmdSpoolDir={self.root}/spool/%n",
            "SlurmdPidFile": f"SlurmdPidFile={self.root}/slurmd-%n.pid",
            "SlurmdLogFile": f"SlurmdLogFile={self.root}/log/slurmd-%n.log",
            "NodeName": "\n".join(f"NodeName={name} NodeAddr={address} CPUs=8 State=UNKNOWN"
                                  for name, address in net.nodes.items()),
            "PartitionName": f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP "
                             "OverSubscribe=FORCE:4",
        }
        return "\n".join(rewritten.get(line.split("=", 1)[0], line) for line in lines) + "\n"

    def _start_nodes(self) -> None:
        for name in self.network.nodes:
            (self.root / "spool" / name).mkdir(mode=0o700, parents=True, exist_ok=True)
            self._daemon(*self.network.run_on(name, "slurmd", "-D", "-N", name, "-f", str(self.conf)))

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted((self.root / "log").glob("*.log")))

    def node_of(self, pid: int) -> str | None:
        return next((n for n in self.network.nodes if pid in self.network.pids(n)), None)

    def ranks_on(self, node: str) -> list[int]:
        """The rank processes (submitit's tasks) running on a node."""
        found = []
        for pid in self.network.pids(node):
            try:
                if "submitit" in " ".join(psutil.Process(pid).cmdline()):
                    found.append(pid)
            except psutil.NoSuchProcess:
                pass
        return found

    def idle(self, node: str) -> bool:
        """Nothing runs on the node but its slurmd."""
        return all(p in LocalSlurm.running for p in self.network.pids(node))


class TwoNodeRay:
    """A Ray cluster: the head on the bridge (this machine, no CPUs: the ranks go to the nodes),
    one worker node in each namespace, all started with `ray start --block` as children of the
    session (stopping them stops their Ray processes; never `ray stop`, which stops every Ray
    on the machine). Token authentication, with a token of its own (Ray's default for `ray start`)."""

    STARTED = "Ray runtime started."  # what `ray start` prints once its node registered

    def __init__(self, root, network: Network):
        import secrets

        self.root, self.network, self.daemons, self.attempt = str(root), network, [], 0
        self.address = self._free_address()
        self.env = {**os.environ, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(16)}
        # This process is the driver: Ray reads its token once, so before anything here uses Ray.
        os.environ.update({k: self.env[k] for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN")})

    def _free_address(self) -> str:
        from nbtrain.placements.base import free_port  # outside the range outgoing connections take ports from

        return f"{self.network.gateway}:{free_port('')}"

    @property
    def _attempt_dir(self) -> str:
        return os.path.join(self.root, str(self.attempt))  # short: Ray puts unix sockets (108 bytes at most) below it

    def _daemon(self, name: str, command: list[str]) -> subprocess.Popen:
        import ctypes
        import signal

        def as_a_starting_daemon():
            # PR_SET_PDEATHSIG (survives exec): SIGTERM, and `ray start --block` stops what it started
            ctypes.CDLL(None).prctl(1, signal.SIGTERM)
            os.setpriority(os.PRIO_PROCESS, 0, STARTING_NICENESS)  # see start(); its children inherit it

        log = open(os.path.join(self._attempt_dir, f"{name}.log"), "w")
        self.daemons.append(subprocess.Popen(command, env=self.env, stdin=subprocess.DEVNULL, stdout=log,
                                             stderr=subprocess.STDOUT, preexec_fn=as_a_starting_daemon))
        LocalSlurm.running.add(self.daemons[-1].pid)  # the session's daemons: not a test's leftovers
        log.close()
        return self.daemons[-1]

    def start(self, timeout: float = 300.0, tries: int = 3) -> None:
        """Start the head, then each node once the one before has registered. Ray gives a starting
        node a fixed 30 s to register with its GCS, which a loaded 2-core machine misses (three
        nodes starting at once beside the other tests' work: "The current node timed out during
        startup"); so the nodes start one at a time, their processes ahead of the other tests'
        (`STARTING_NICENESS`) until all have joined, then back at the usual priority, where the
        tests' ranks run. A try in which a daemon still gave up is stopped whole and made again:
        a `ray start` that gave up leaves nothing to connect to."""
        import ray

        deadline = time.monotonic() + timeout
        while True:
            self.attempt += 1
            os.makedirs(self._attempt_dir)
            ended = self._start_nodes(deadline)
            if ended is None:
                break
            if time.monotonic() >= deadline or self.attempt == tries:
                raise RuntimeError(f"the Ray {ended} did not start (try {self.attempt} of {tries}):\n{self.logs()}")
            self._stop_daemons()
            self.address = self._free_address()
        self._connect(deadline)
        joined = wait_until(lambda: len([n for n in ray.nodes() if n["Alive"]]) == 3, deadline - time.monotonic())
        self._at_usual_priority()
        if not joined:
            raise RuntimeError(f"the Ray nodes did not join within {timeout:g} s:\n{self.logs()}")

    def _start_nodes(self, deadline: float) -> str | None:
        """Start the head, then each node, each once the last said that it started; None when all
        did, else the first that ended (its name and exit code) or did not start by the deadline."""
        port = self.address.rsplit(":", 1)[1]
        common = ["--block", "--disable-usage-stats"]
        ray_cli = os.path.join(os.path.dirname(sys.executable), "ray")  # this venv's, active or not
        commands = {"head": [ray_cli, "start", "--head", f"--port={port}", f"--node-ip-address={self.network.gateway}",
                             "--num-cpus=0", "--include-dashboard=false", f"--temp-dir={self._attempt_dir}/head",
                             *common]}
        for name, address in self.network.nodes.items():
            commands[name] = self.network.run_on(name, ray_cli, "start", f"--address={self.address}",
                                                 f"--node-ip-address={address}", "--num-cpus=2",
                                                 f"--temp-dir={self._attempt_dir}/{name}", *common)
        for name, command in commands.items():
            process = self._daemon(name, command)
            while True:
                with open(os.path.join(self._attempt_dir, f"{name}.log")) as log:
                    if self.STARTED in log.read():
                        break
                if process.poll() is not None:
                    return f"{name} (exit code {process.returncode})"
                if time.monotonic() >= deadline:
                    return f"{name} (not started by the deadline)"
                time.sleep(0.2)
        return None

    def _processes(self) -> list[psutil.Process]:
        """This cluster's processes, found by its own folder in their command lines (never by name)."""
        return [p for p in psutil.process_iter(["cmdline"]) if any(self.root in part for part in p.info["cmdline"] or ())]

    def _at_usual_priority(self) -> None:
        for process in self._processes():
            try:
                process.nice(0)
            except psutil.Error:
                pass

    def _connect(self, deadline: float) -> None:
        """ray.init as this session's driver, again until the deadline: under load the head's port
        listens before its GCS answers, and ray.init then raises ConnectionError."""
        import ray

        # Ray's C++ side reads its auth mode and token once per process: when an earlier test
        # imported Ray here, before this cluster's token was set, it would dial without one.
        try:
            from ray._private.authentication_test_utils import reset_auth_token_state
        except ImportError:  # an older Ray: no token authentication to reset
            pass
        else:
            reset_auth_token_state()
        while True:
            try:
                ray.init(address=self.address, _node_ip_address=self.network.gateway)
                return
            except ConnectionError as exc:
                ray.shutdown()  # a half-made connection would make the next ray.init refuse to start
                if time.monotonic() >= deadline:
                    raise RuntimeError(f"could not connect to the Ray head at {self.address}: {exc}\n"
                                       f"{self.logs()}") from None
                time.sleep(1)

    def logs(self) -> str:
        where = self._attempt_dir  # the latest try's
        return "\n".join(f"--- {name}\n{open(os.path.join(where, name)).read()[-2000:]}"
                          for name in sorted(os.listdir(where)) if name.endswith(".log"))

    def actors_on(self, node: str) -> list[int]:
        """The rank actors' processes (`ray::RankActor`) on a node."""
        found = []
        for pid in self.network.pids(node):
            try:
                if "RankActor" in " ".join(psutil.Process(pid).cmdline()):
                    found.append(pid)
            except psutil.NoSuchProcess:
                pass
        return found

    def stop(self) -> None:
        import ray

        ray.shutdown()
        for name in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN"):
            os.environ.pop(name, None)
        self._stop_daemons()
        shutil.rmtree(self.root, ignore_errors=True)

    def _stop_daemons(self) -> None:
        """Stop this cluster's `ray start` processes, then what they started and left: a `ray
        start` that gave up leaves its GCS or raylet running. Those are found by this cluster's
        own temporary folder in their command lines, never by name."""
        for process in reversed(self.daemons):  # the workers first, then the head
            process.terminate()
        for process in self.daemons:
            try:
                process.wait(40)  # a node drains for up to 30 s
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            LocalSlurm.running.discard(process.pid)
        self.daemons = []
        left = self._processes()
        for process in left:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(left, timeout=10)


def wait_until(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return bool(condition())
