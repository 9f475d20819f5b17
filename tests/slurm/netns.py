"""A real multi-node Slurm cluster on this host, for tests and CI: each node a network namespace.

    python tests/slurm/netns.py start  [--root DIR] [--nodes N]   # install if missing, start afresh, wait for idle
    python tests/slurm/netns.py status [--root DIR] [--nodes N]
    python tests/slurm/netns.py stop   [--root DIR] [--nodes N]   # stop only what it started, delete its namespaces
    python tests/slurm/netns.py exec   [--root DIR] [--nodes N] -- sinfo -N    # a client command, in its namespace

N nodes pt-node1..N (default 3). Each is a network namespace with its own hostname (a UTS namespace), its own
/etc/hosts (a bind mount inside its own mount namespace: the host's file is never touched), an address on a bridge,
and its own `slurmd -N <node>` with its own spool, log and pid files. slurmctld runs in the bridge's namespace on
the bridge's address; one munged in the host's namespace serves all (a unix socket is reachable from every network
namespace). Everything lives under DIR (default $PRETRAIN_SLURM_NETNS_DIR or /tmp/pretrain-slurm-netns).

What it creates is named pt-<hash of DIR>-{ctl,n1,...} and recorded under DIR before it is made (network.json,
daemons.json); the harness only ever addresses those namespaces and loopback, so the host's own interfaces, routes
and addresses are never changed. `stop` stops the recorded PIDs, kills what is left inside its own namespaces (only
its daemons and their jobs can be there) and deletes the namespaces, and with them every veth and the bridge; the
next `start` first removes whatever a crashed run left behind. Where namespaces cannot be made (not root, no
iproute2/util-linux, no permission) `start` raises NetnsUnavailable and the tests skip.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path


def _load_cluster():
    """tests/slurm/cluster.py (tests/ is not a package), the same module object the tests load."""
    name = "slurm_cluster"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name("cluster.py"))
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


_cluster = _load_cluster()
BINARIES, ClusterError, SlurmUnavailable = _cluster.BINARIES, _cluster.ClusterError, _cluster.SlurmUnavailable
install_if_missing, wait_until, _COMMON_SETTINGS = _cluster.install_if_missing, _cluster.wait_until, _cluster._COMMON_SETTINGS
_node_hardware, _is_ours, _terminate = _cluster._node_hardware, _cluster._is_ours, _cluster._terminate

DEFAULT_NETNS_ROOT = Path(os.environ.get("PRETRAIN_SLURM_NETNS_DIR", "/tmp/pretrain-slurm-netns"))


class NetnsUnavailable(ClusterError):
    """Network namespaces cannot be made here (not root, no iproute2/util-linux, no permission)."""


@dataclass(frozen=True)
class NetnsCluster(_cluster.ClusterFiles):
    """`num_nodes` Slurm nodes on this host, each in its own network namespace (see the module docstring).

    Addresses (10.77.0.0/24) exist only inside this cluster's namespaces: the controller is .1 on the bridge,
    node i is .(10+i). Client commands must run in the bridge's namespace: use `cmd([...])` or `run([...])`.
    """

    root: Path = DEFAULT_NETNS_ROOT
    num_nodes: int = 3

    SUBNET = "10.77.0"
    CTL_HOST = "pt-ctl"

    def __post_init__(self) -> None:
        if not 2 <= self.num_nodes <= 9:
            raise ValueError(f"NetnsCluster needs 2..9 nodes, got {self.num_nodes}")

    # -- names -------------------------------------------------------------------------------------
    @property
    def tag(self) -> str:
        """pt-<6 hex of the root path>: the prefix of every namespace of this cluster."""
        return "pt-" + hashlib.sha1(str(self.root).encode()).hexdigest()[:6]

    @property
    def ctl_ns(self) -> str:
        return f"{self.tag}-ctl"

    @property
    def nodes(self) -> list[str]:
        return [f"pt-node{i}" for i in range(1, self.num_nodes + 1)]

    def node_ns(self, node: str) -> str:
        return f"{self.tag}-n{self._index(node)}"

    def node_addr(self, node: str) -> str:
        return f"{self.SUBNET}.{10 + self._index(node)}"

    def _index(self, node: str) -> int:
        if node not in self.nodes:
            raise ValueError(f"{node!r} is not a node of this cluster ({self.nodes})")
        return self.nodes.index(node) + 1

    @property
    def network_file(self) -> Path:
        return self.root / "network.json"

    # -- clients -----------------------------------------------------------------------------------
    def cmd(self, argv: list[str]) -> list[str]:
        """A client command line (sbatch, squeue, ...) run in the controller's namespace."""
        return ["nsenter", f"--net=/run/netns/{self.ctl_ns}", *argv]

    def run(self, argv: list[str], *, env: dict[str, str] | None = None,
            timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(self.cmd(argv), env=self.env(env), capture_output=True, text=True, timeout=timeout)

    def node_states(self) -> dict[str, str]:
        out = self.run(["sinfo", "-h", "-N", "-o", "%N %t"])
        if out.returncode != 0:
            return {"error": out.stderr.strip()}
        return dict(line.split() for line in out.stdout.splitlines() if line.strip())

    # -- files -------------------------------------------------------------------------------------
    def _write_files(self) -> None:
        for sub in ("munge", "state", "log", "run", *(f"spool/{n}" for n in self.nodes)):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o711)
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        hosts = [f"{self.SUBNET}.1 {self.CTL_HOST}", *(f"{self.node_addr(n)} {n}" for n in self.nodes)]
        # What every namespace sees as /etc/hosts: node names resolve (MASTER_ADDR, gloo) without DNS.
        (self.root / "hosts").write_text("127.0.0.1 localhost\n::1 localhost ip6-localhost\n" + "\n".join(hosts) + "\n")
        self.conf.write_text(self._render())

    def _render(self) -> str:
        r, hw = self.root, " ".join(f"{k}={v}" for k, v in _node_hardware().items())
        nodes = "\n".join(f"NodeName={n} NodeHostname={n} NodeAddr={self.node_addr(n)} {hw} State=UNKNOWN"
                          for n in self.nodes)
        return f"""\
# Generated by tests/slurm/cluster.py: {self.num_nodes} nodes in network namespaces {self.tag}-*, no cgroups,
# everything under {r}. The ports are the namespaces' own: nothing listens on the host's network.
ClusterName=pretrainnetns
SlurmctldHost={self.CTL_HOST}({self.SUBNET}.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket,cred_expire=10
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
{_COMMON_SETTINGS}\
# Slurm's default: a lost node is declared DOWN only after 5 min, so a test sees what the job does by itself.
SlurmdTimeout=300
{nodes}
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""

    # -- network -----------------------------------------------------------------------------------
    def _namespaces(self) -> list[str]:
        return [self.ctl_ns, *(self.node_ns(n) for n in self.nodes)]

    @staticmethod
    def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run(["ip", *args], capture_output=True, text=True, timeout=30)
        if check and proc.returncode != 0:
            raise ClusterError(f"ip {' '.join(args)} failed: {proc.stderr.strip()}")
        return proc

    def _create_network(self) -> None:
        """The bridge's namespace with the controller's address, a namespace per node with eth0 on the bridge."""
        self.network_file.write_text(json.dumps({"namespaces": self._namespaces()}))  # before: a crash cleans up
        first = self._ip("netns", "add", self.ctl_ns, check=False)
        if first.returncode != 0:
            self.network_file.unlink()
            raise NetnsUnavailable(f"cannot create a network namespace (ip netns add: {first.stderr.strip()})")
        try:
            self._ip("-n", self.ctl_ns, "link", "set", "lo", "up")
            self._ip("-n", self.ctl_ns, "link", "add", "br0", "type", "bridge")
        except ClusterError as e:
            self._delete_network()
            raise NetnsUnavailable(f"cannot create a bridge in a network namespace ({e})") from None
        self._ip("-n", self.ctl_ns, "addr", "add", f"{self.SUBNET}.1/24", "dev", "br0")
        self._ip("-n", self.ctl_ns, "link", "set", "br0", "up")
        for node in self.nodes:
            ns, port = self.node_ns(node), f"v{self._index(node)}"
            self._ip("netns", "add", ns)
            self._ip("-n", ns, "link", "set", "lo", "up")
            # The veth is made inside the bridge's namespace, its peer moved straight into the node's.
            self._ip("-n", self.ctl_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            self._ip("-n", self.ctl_ns, "link", "set", port, "master", "br0", "up")
            self._ip("-n", ns, "addr", "add", f"{self.node_addr(node)}/24", "dev", "eth0")
            self._ip("-n", ns, "link", "set", "eth0", "up")

    def _ns_pids(self, ns: str) -> list[int]:
        out = self._ip("netns", "pids", ns, check=False)
        return [int(p) for p in out.stdout.split()] if out.returncode == 0 else []

    def _delete_network(self) -> None:
        """Kill what is left in the recorded namespaces (only this cluster's daemons and jobs can be there), delete them."""
        try:
            names = json.loads(self.network_file.read_text())["namespaces"]
        except (FileNotFoundError, ValueError, KeyError):
            return
        existing = set(self._ip("netns", "list", check=False).stdout.split())
        for ns in reversed(names):
            if ns not in existing:
                continue
            for _ in range(50):
                pids = self._ns_pids(ns)
                if not pids:
                    break
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                time.sleep(0.1)
            self._ip("netns", "del", ns, check=False)
        self.network_file.unlink(missing_ok=True)

    def kill_node(self, node: str) -> list[int]:
        """Lose `node` as a crash does: its processes frozen, its cable pulled (no FIN/RST reaches anyone), then
        every process in its namespace (slurmd, slurmstepd, the job's tasks) SIGKILLed. Returns the PIDs."""
        ns, killed = self.node_ns(node), []
        for sig in (signal.SIGSTOP, None, signal.SIGKILL):
            if sig is None:
                self._ip("-n", self.ctl_ns, "link", "set", f"v{self._index(node)}", "down")
                continue
            for pid in self._ns_pids(ns):
                try:
                    os.kill(pid, sig)
                    killed.append(pid)
                except ProcessLookupError:
                    pass
        return sorted(set(killed))

    def revive_node(self, node: str) -> int:
        """Bring a node lost by `kill_node` back: its cable plugged in again and a fresh slurmd started in its
        namespace (recorded, so `stop` stops it). Slurm returns it to service when it registers
        (ReturnToService=2), also after it was set DOWN. Returns the new slurmd's PID."""
        self._ip("-n", self.ctl_ns, "link", "set", f"v{self._index(node)}", "up")
        name = f"slurmd {node}"
        with open(self.root / "log" / f"{name.replace(' ', '-')}.stdout", "ab") as log:
            proc = subprocess.Popen(self._commands()[name], stdout=log, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        self.state_file.write_text(json.dumps({**self._recorded(), name: proc.pid}))
        return proc.pid

    @staticmethod
    def kill_job(job_id: str) -> list[int]:
        """SIGKILL every process of Slurm job `job_id` (those whose environment names it: the batch script, srun,
        torchrun, the trainer's ranks), as Slurm does once KillWait has passed; Slurm's daemons stay. The nodes'
        namespaces share this machine's PID space. Returns the PIDs.

        Each one is frozen (SIGSTOP) as the scan of /proc finds it, and all are killed once the scan is done. Killed
        one by one as found, the ranks were gone before the scan reached them (stop 38's CI saw 3 of the job's 7+
        processes; most likely their step ended them once srun was killed), so what was killed depended on how
        fast this machine was."""
        found = []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit():
                continue
            try:
                environ = (proc / "environ").read_bytes().split(b"\0")
            except OSError:  # gone, or a kernel thread
                continue
            if f"SLURM_JOB_ID={job_id}".encode() in environ:
                try:
                    os.kill(int(proc.name), signal.SIGSTOP)
                    found.append(int(proc.name))
                except ProcessLookupError:
                    pass
        killed = []
        for pid in found:
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
        return sorted(killed)

    # -- daemons -----------------------------------------------------------------------------------
    def _in_ns(self, ns: str, hostname: str, argv: list[str]) -> list[str]:
        """argv in namespace `ns` with its own hostname and /etc/hosts (UTS + private mount namespace); the
        shell execs argv, so the PID started is argv's."""
        script = (f'echo {hostname} > /proc/sys/kernel/hostname && mount --bind {self.root}/hosts /etc/hosts '
                  f'&& exec "$@"')
        return ["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--mount", "--propagation", "private",
                "sh", "-c", script, "sh", *argv]

    def _commands(self) -> dict[str, list[str]]:
        r, conf = self.root, str(self.conf)
        cmds = {
            "munged": [BINARIES["munged"], "-F", "--force", f"--socket={r}/munge/munge.socket",
                       f"--key-file={r}/munge/munge.key", f"--pid-file={r}/munge/munged.pid",
                       f"--seed-file={r}/munge/munged.seed", f"--log-file={r}/log/munged.log"],
            "slurmctld": self._in_ns(self.ctl_ns, self.CTL_HOST, [BINARIES["slurmctld"], "-D", "-c", "-i", "-f", conf]),
        }
        for node in self.nodes:
            cmds[f"slurmd {node}"] = self._in_ns(self.node_ns(node), node,
                                                 [BINARIES["slurmd"], "-D", "-N", node, "-f", conf])
        return cmds

    def _recorded(self) -> dict[str, int]:
        try:
            return {k: int(v) for k, v in json.loads(self.state_file.read_text()).items()}
        except (FileNotFoundError, ValueError):
            return {}

    def _is_ours(self, name: str, pid: int) -> bool:
        return _is_ours(BINARIES[name.split()[0]], self.root, pid)

    def alive(self) -> dict[str, int]:
        return {n: p for n, p in self._recorded().items() if self._is_ours(n, p)}

    @staticmethod
    def check_possible() -> None:
        """Raise NetnsUnavailable (the tests skip) where namespaces cannot be made at all."""
        if os.geteuid() != 0:
            raise NetnsUnavailable(f"network namespaces need root (running as uid {os.geteuid()})")
        missing = [t for t in ("ip", "nsenter", "unshare", "mount") if shutil.which(t) is None]
        if missing:
            raise NetnsUnavailable(f"{', '.join(missing)} not found (apt-get install iproute2 util-linux mount)")

    def start(self, timeout_s: float = 60.0) -> bool:
        """Start the cluster afresh (removing what an earlier run left behind); True when it was started."""
        self.check_possible()
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            self.stop()  # leftovers of a crashed run under this root: exactly what its records name
            install_if_missing()
            self._write_files()
            try:
                self._create_network()
                self._start_daemons(timeout_s)
            except NetnsUnavailable:
                raise  # nothing of ours is left: _create_network removed what it had made
            except BaseException:
                self.stop()
                raise
            return True

    def _start_daemons(self, timeout_s: float) -> None:
        pids: dict[str, int] = {}
        for name, cmd in self._commands().items():
            with open(self.root / "log" / f"{name.replace(' ', '-')}.stdout", "ab") as log:
                proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                        start_new_session=True)
            pids[name] = proc.pid
            self.state_file.write_text(json.dumps(pids))
            if name == "munged":
                wait_until(lambda: (self.root / "munge" / "munge.socket").exists(), 10, proc, self.root)
            elif name == "slurmctld":
                wait_until(lambda: "error" not in self.node_states(), 20, proc, self.root)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            states = self.node_states()
            if sorted(states) == self.nodes and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.3)
        raise ClusterError(f"nodes not idle after {timeout_s}s ({self.node_states()}); see {self.root}/log/")

    def stop(self, timeout_s: float = 15.0) -> None:
        """Cancel the jobs, stop the recorded daemons by PID, then clear and delete the recorded namespaces."""
        alive = self.alive()
        if "slurmctld" in alive and (self.root / "network.json").exists():
            jobs = self.run(["squeue", "-h", "-o", "%A"]).stdout.split()
            if jobs:
                self.run(["scancel", *jobs])
        for name in reversed(list(alive)):  # slurmds, slurmctld, munged
            _terminate(alive[name], lambda: self._is_ours(name, alive[name]), timeout_s)
        self.state_file.unlink(missing_ok=True)
        self._delete_network()

    def status(self) -> dict:
        alive = self.alive()
        return {"root": str(self.root), "namespaces": self._namespaces(), "daemons": alive,
                "nodes": self.node_states() if "slurmctld" in alive else "down"}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    command = argv[argv.index("--") + 1:] if "--" in argv else []  # exec: the client command, after --
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["start", "stop", "status", "exec"])
    parser.add_argument("--root", type=Path, default=DEFAULT_NETNS_ROOT)
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    cluster = NetnsCluster(args.root.resolve(), args.nodes)
    try:
        if args.action == "start":
            cluster.start(args.timeout)
            print(f"started {args.nodes} nodes under {cluster.root} ({cluster.alive()}): {cluster.node_states()}; "
                  f"run client commands with: python {__file__} exec -- sinfo", file=sys.stderr)
        elif args.action == "stop":
            alive = cluster.alive()
            cluster.stop()
            print(f"stopped {alive or 'nothing (no daemons of ours running)'}; deleted {cluster.tag}-*", file=sys.stderr)
        elif args.action == "status":
            print(json.dumps(cluster.status()))
            return 0 if len(cluster.alive()) == 2 + args.nodes else 1
        else:
            return subprocess.run(cluster.cmd(command), env=cluster.env()).returncode
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
