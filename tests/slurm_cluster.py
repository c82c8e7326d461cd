"""A real single-machine SLURM cluster for the tests marked ``slurm`` (Debian's slurm-wlm + munge).

    with SlurmCluster(tmp_dir, nodes=("vm",)) as cluster:       # one node: this machine
        cluster.env           # os.environ + SLURM_CONF, for sbatch / squeue / hydra's submitit launcher
        cluster.wait_state(job_id, "COMPLETED")

Daemons run as root without systemd, with every file (config, state, spool, pid, logs) under the given
folder, and are stopped by pid when the ``with`` ends, also when a test fails. Two nodes are emulated
on the one machine: each ``slurmd`` runs in its own network namespace (a veth pair into a bridge,
its own address on a private /24 used by nothing else), with its own host name, as real hosts are;
``/etc/hosts`` names them for the time the cluster is up. Facts behind the settings:
../shared/reference/slurm.md (requeue delay, scheduling interval, EnforcePartLimits).

``unavailable()`` says why no cluster can be brought up here (packages missing, not root), or None.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

SLURM_BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "scontrol", "squeue")
BRIDGE = "vsabr0"
SUBNET = "10.231.77"  # a private /24 used by nothing else on these machines; never routed
HOSTS_MARK = "# visattn-test-slurm"


def unavailable(nodes: int = 1) -> str | None:
    """Why a cluster of ``nodes`` nodes cannot be brought up here (None when it can)."""
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if missing:
        return (f"SLURM is not installed ({', '.join(missing)} missing): apt-get install slurm-wlm munge "
                "(.ci/run does) to run the cluster tests")
    if os.geteuid() != 0:
        return "the SLURM daemons of the cluster tests run as root; run the tests as root"
    if nodes > 1 and shutil.which("ip") is None:
        return "two emulated nodes need iproute2's ip (apt-get install iproute2)"
    return None


def _run(*cmd: str, check: bool = True, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), check=check, capture_output=True, text=True, **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmCluster:
    """``nodes``: node names; one node is this machine (its host name), two or more are emulated
    in network namespaces (``node1``, ``node2``, ...). ``cpus``: CPUs each node offers."""

    def __init__(self, root: str | Path, nodes: int = 1, cpus: int = 16, memory_mb: int = 16000) -> None:
        self.root = Path(root)
        self.emulated = nodes > 1
        self.nodes = [f"node{i + 1}" for i in range(nodes)] if self.emulated else [socket.gethostname()]
        self.cpus, self.memory_mb = cpus, memory_mb
        self.conf = self.root / "slurm.conf"
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        self._munged_pid_file: Path | None = None
        self.munge_socket: Path | None = None
        self._netns: list[str] = []

    # ------------------------------------------------------------------ set-up
    def __enter__(self) -> SlurmCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        for sub in ("state", "spool", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        self._start_munge()
        controller = self.nodes[0] if not self.emulated else socket.gethostname()
        if self.emulated:
            self._network()
        self.conf.write_text(self._slurm_conf(controller))
        _run("/usr/sbin/slurmctld", "-f", str(self.conf), env=self.env)
        for node in self.nodes:
            self._start_slurmd(node)
        self.wait_nodes_idle()

    def _slurm_conf(self, controller: str) -> str:
        r = self.root
        node_lines = []
        for i, node in enumerate(self.nodes):
            addr = f" NodeAddr={SUBNET}.{10 + i}" if self.emulated else ""
            node_lines.append(f"NodeName={node}{addr} CPUs={self.cpus} RealMemory={self.memory_mb} State=UNKNOWN")
        names = ",".join(self.nodes)
        ctl_port, d_port = _free_port(), _free_port()
        return "\n".join([
            "ClusterName=visattntest",
            f"SlurmctldHost={controller}" + (f"({SUBNET}.1)" if self.emulated else ""),
            "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={ctl_port}", f"SlurmdPort={d_port}",
            "AuthType=auth/munge", "CredType=cred/munge",
            # a requeued job may start again after ~10 s, not ~121 s
            f"AuthInfo=socket={self.munge_socket},cred_expire=10",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_Core",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none",
            "MpiDefault=none", "SwitchType=switch/none", "ReturnToService=2",
            "SlurmdParameters=config_overrides",  # nodes offer the CPUs configured here, not the machine's 2
            "JobRequeue=1", "PreemptType=preempt/partition_prio", "PreemptMode=REQUEUE",
            "EnforcePartLimits=ALL",  # a job no node can ever run is refused, not left pending
            "SchedulerParameters=bf_interval=5,sched_interval=5",
            "KillWait=30", "InactiveLimit=0", "MinJobAge=300",
            *node_lines,
            f"PartitionName=debug Nodes={names} Default=YES MaxTime=INFINITE State=UP PriorityTier=1",
            f"PartitionName=urgent Nodes={names} MaxTime=INFINITE State=UP PriorityTier=10",
            # as urgent's tier, so never preempted by it: for jobs that must run undisturbed beside a preemption
            f"PartitionName=steady Nodes={names} MaxTime=INFINITE State=UP PriorityTier=10",
            "",
        ])

    def _start_munge(self) -> None:
        """A munged of this cluster's own (its socket, pid, log and seed under ``root/munge``, run as the
        munge user), so clusters of tests that run side by side never share or stop each other's."""
        folder = self.root / "munge"
        folder.mkdir(mode=0o700, exist_ok=True)
        shutil.chown(folder, "munge", "munge")
        self.root.chmod(0o755)  # the munge user must reach its folder
        for parent in self.root.parents:  # pytest's temp folders are 0700
            if parent == Path("/tmp") or parent == Path("/"):
                break
            parent.chmod(parent.stat().st_mode | 0o011)
        self.munge_socket = folder / "munge.socket"
        _run("runuser", "-u", "munge", "--", "/usr/sbin/munged", f"--socket={self.munge_socket}",
             f"--pid-file={folder / 'munged.pid'}", f"--log-file={folder / 'munged.log'}",
             f"--seed-file={folder / 'munged.seed'}", "--force")
        self._munged_pid_file = folder / "munged.pid"

    def _network(self) -> None:
        """A bridge on the host at .1 and one namespace per node at .10, .11, ..."""
        _run("ip", "link", "add", BRIDGE, "type", "bridge", check=False)
        _run("ip", "addr", "add", f"{SUBNET}.1/24", "dev", BRIDGE, check=False)
        _run("ip", "link", "set", BRIDGE, "up")
        hosts = [f"{SUBNET}.1 {socket.gethostname()}-ctl"]
        for i, node in enumerate(self.nodes):
            ns, veth = f"vsa-{node}", f"vsa{i}"
            _run("ip", "netns", "add", ns)
            self._netns.append(ns)
            _run("ip", "link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _run("ip", "link", "set", veth, "master", BRIDGE)
            _run("ip", "link", "set", veth, "up")
            _run("ip", "-n", ns, "addr", "add", f"{SUBNET}.{10 + i}/24", "dev", "eth0")
            _run("ip", "-n", ns, "link", "set", "eth0", "up")
            _run("ip", "-n", ns, "link", "set", "lo", "up")
            hosts.append(f"{SUBNET}.{10 + i} {node}")
        text = Path("/etc/hosts").read_text()
        Path("/etc/hosts").write_text(text + "".join(f"{h} {HOSTS_MARK}\n" for h in hosts))

    def _start_slurmd(self, node: str) -> None:
        cmd = ["/usr/sbin/slurmd", "-f", str(self.conf), "-N", node]
        if self.emulated:  # its own network and host name, as a real host has (ip netns exec would remount /sys)
            cmd = ["nsenter", f"--net=/run/netns/vsa-{node}", "unshare", "--uts", "sh", "-c",
                   f"hostname {node} && exec {' '.join(cmd)}"]
        _run(*cmd, env=self.env)

    def wait_nodes_idle(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            out = _run("sinfo", "-h", "-N", "-o", "%N %t", env=self.env, check=False).stdout.split()
            states = dict(zip(out[::2], out[1::2], strict=False))
            if all(states.get(n) in ("idle", "mix", "alloc") for n in self.nodes):
                return
            time.sleep(0.5)
        raise TimeoutError(f"SLURM nodes not idle after {timeout:.0f} s: {states}; see {self.root / 'log'}")

    # ------------------------------------------------------------------ jobs
    def job_state(self, job_id: str) -> str:
        out = _run("scontrol", "-o", "show", "job", job_id, env=self.env, check=False).stdout
        for field in out.split():
            if field.startswith("JobState="):
                return field.split("=", 1)[1]
        return "UNKNOWN"

    def job_field(self, job_id: str, name: str) -> str | None:
        out = _run("scontrol", "-o", "show", "job", job_id, env=self.env, check=False).stdout
        for field in out.split():
            if field.startswith(name + "="):
                return field.split("=", 1)[1]
        return None

    def wait_state(self, job_id: str, *states: str, timeout: float = 120.0) -> str:
        deadline = time.monotonic() + timeout
        state = "UNKNOWN"
        while time.monotonic() < deadline:
            state = self.job_state(job_id)
            if state in states:
                return state
            time.sleep(0.5)
        raise TimeoutError(f"job {job_id} is {state}, not {'/'.join(states)}, after {timeout:.0f} s")

    def scontrol(self, *args: str) -> subprocess.CompletedProcess:
        return _run("scontrol", *args, env=self.env, check=False)

    # ------------------------------------------------------------------ tear-down
    def stop(self) -> None:
        """Every job still there (cancelled, so no job step outlives its cluster), every daemon this
        cluster started, by its pid file; then the namespaces and host names."""
        if self.conf.is_file():
            _run("scancel", "--full", "--user", "root", env=self.env, check=False, timeout=30)
            time.sleep(1)
        pids = [self.root / "slurmctld.pid", *(self.root / f"slurmd-{n}.pid" for n in self.nodes)]
        for pid_file in pids:
            self._kill(pid_file)
        if self._munged_pid_file is not None:
            self._kill(self._munged_pid_file)
        for ns in self._netns:
            _run("ip", "netns", "delete", ns, check=False)
        if self.emulated:
            _run("ip", "link", "delete", BRIDGE, check=False)
            hosts = Path("/etc/hosts")
            hosts.write_text("".join(line for line in hosts.read_text().splitlines(True) if HOSTS_MARK not in line))

    def _kill(self, pid_file: Path) -> None:
        try:
            pid = int(pid_file.read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return
        self._kill_pid(pid)

    @staticmethod
    def _kill_pid(pid: int) -> None:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        for _ in range(50):
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(0.1)
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
