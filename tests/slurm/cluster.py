"""A real one-node Slurm cluster on this host, for tests and CI (several nodes: tests/slurm/netns.py).

    python tests/slurm/cluster.py start   [--root DIR]   # install if missing, start, wait for idle
    python tests/slurm/cluster.py status  [--root DIR]
    python tests/slurm/cluster.py stop    [--root DIR]   # stop only the daemons it started
    eval "$(python tests/slurm/cluster.py env)"          # export SLURM_CONF for sbatch/squeue/...

Everything lives under DIR (default $PRETRAIN_SLURM_DIR or /tmp/pretrain-slurm): munge key and
socket, slurm.conf, spool/state dirs, logs, and daemons.json with the PIDs this harness started.
`start` is idempotent: if the daemons recorded there are alive and answer, they are reused.
Daemons run as root (SlurmUser=root), with proctrack/linuxproc and task/none (no cgroups).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ROOT = Path(os.environ.get("PRETRAIN_SLURM_DIR", "/tmp/pretrain-slurm"))
DAEMONS = ("munged", "slurmctld", "slurmd")  # start order; stop order is reversed
BINARIES = {"munged": "/usr/sbin/munged", "slurmctld": "/usr/sbin/slurmctld", "slurmd": "/usr/sbin/slurmd"}


class ClusterError(RuntimeError):
    """The local cluster cannot be started or used; the message says what to do."""


class SlurmUnavailable(ClusterError):
    """Slurm/munge are not installed and cannot be installed on this machine."""


def install_if_missing() -> None:
    """apt-get install slurm-wlm and munge when a daemon binary is missing (needs root)."""
    if all(Path(p).exists() for p in BINARIES.values()) and shutil.which("sbatch"):
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise SlurmUnavailable("slurm-wlm/munge are missing and cannot be installed here "
                           "(needs root and apt-get): apt-get install -y slurm-wlm munge")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    known = subprocess.run(["apt-cache", "policy", "slurm-wlm"], capture_output=True, text=True, env=env)
    if "Candidate: (none)" in known.stdout or "Candidate" not in known.stdout:
        subprocess.run(["apt-get", "update"], env=env, capture_output=True)
    proc = subprocess.run(["apt-get", "install", "-y", "slurm-wlm", "munge"], env=env,
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise SlurmUnavailable(f"apt-get install slurm-wlm munge failed:\n{proc.stderr[-2000:]}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_hardware() -> dict[str, str]:
    """This host as Slurm sees it (`slurmd -C`): CPUs, sockets/cores/threads, memory."""
    out = subprocess.run([BINARIES["slurmd"], "-C"], capture_output=True, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("NodeName="))
    fields = dict(kv.split("=", 1) for kv in line.split())
    del fields["NodeName"]
    # Leave memory headroom so a busy host is not drained for "low RealMemory".
    fields["RealMemory"] = str(max(int(fields.get("RealMemory", "1024")) * 9 // 10, 256))
    return fields


def _node_line() -> str:
    """This host as one node: NodeName, hardware, on loopback."""
    hw = " ".join(f"{k}={v}" for k, v in _node_hardware().items())
    return f"NodeName={socket.gethostname()} {hw} NodeAddr=127.0.0.1 State=UNKNOWN"


def _is_ours(binary: str, root: Path, pid: int) -> bool:
    """PID is alive and is still `binary` started with a path under `root` (not a recycled PID)."""
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        stat = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()
    except OSError:
        return False
    return stat[0] != "Z" and bool(cmd) and cmd[0].decode() == binary and str(root).encode() in b" ".join(cmd)


def _terminate(pid: int, still_ours, timeout_s: float) -> None:
    """SIGTERM, then SIGKILL after timeout_s, a PID for as long as `still_ours()` says it is ours."""
    if not still_ours():
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and still_ours():
        time.sleep(0.1)
    if still_ours():
        os.kill(pid, signal.SIGKILL)
    try:  # reap if it is our child (same process started it)
        os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        pass


def wait_until(ready, timeout_s: float, proc: subprocess.Popen, root: Path) -> None:
    """Poll `ready()` until true; ClusterError if the daemon `proc` exits or time runs out."""
    name = Path(proc.args[0]).name
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise ClusterError(f"{name} exited at start; see {root}/log/{name}.*")
        if ready():
            return
        time.sleep(0.2)
    raise ClusterError(f"{name} did not come up in {timeout_s}s; see {root}/log/")


_COMMON_SETTINGS = """\
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
ReturnToService=2
JobRequeue=1
KillWait=10
MinJobAge=600
InactiveLimit=0
"""
"""slurm.conf lines every test cluster shares (netns.py too): no cgroups, quick scheduling, requeue, short KillWait."""


class ClusterFiles:
    """What every test cluster (this one-node one and netns.py's) has under its `root`: the config, the record of
    the daemons it started, and the environment its client commands need."""

    root: Path

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def state_file(self) -> Path:
        return self.root / "daemons.json"

    def env(self, base: dict[str, str] | None = None) -> dict[str, str]:
        """An environment for Slurm client commands (sbatch, squeue, scontrol) of this cluster."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.conf)}


@dataclass(frozen=True)
class LocalCluster(ClusterFiles):
    """A one-node Slurm cluster whose files all live under `root`."""

    root: Path = DEFAULT_ROOT

    # -- files -------------------------------------------------------------------------------

    def _write_files(self) -> None:
        for sub in ("munge", "spool", "state", "log"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o711)  # socket dir: x for all, as munged wants
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o600)
        self.conf.write_text(self._render(_free_port(), _free_port()))

    def _render(self, ctld_port: int, slurmd_port: int) -> str:
        r = self.root
        return f"""\
# Generated by tests/slurm/cluster.py: one node (this host), no cgroups, everything under {r}.
ClusterName=pretraintest
SlurmctldHost={socket.gethostname()}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={r}/munge/munge.socket,cred_expire=10
# cred_expire is also how long a requeued job waits before it may start again (default 120 s).
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/slurmctld.pid
SlurmdPidFile={r}/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
{_COMMON_SETTINGS}SlurmdTimeout=60
{_node_line()}
# FORCE:4 lets up to 4 jobs share a CPU, so tests can run their jobs side by side on a small host.
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""

    def _conf_is_current(self) -> bool:
        """The running slurm.conf is what this version of the harness would write."""
        try:
            text = self.conf.read_text()
            ports = dict(re.findall(r"^(Slurm(?:ctld|d)Port)=(\d+)$", text, re.M))
            return text == self._render(int(ports["SlurmctldPort"]), int(ports["SlurmdPort"]))
        except (OSError, KeyError, subprocess.CalledProcessError):
            return False

    # -- daemons -----------------------------------------------------------------------------

    def _commands(self) -> dict[str, list[str]]:
        r = self.root
        return {
            # --force: /tmp is world-writable (sticky), which munged otherwise refuses.
            "munged": [BINARIES["munged"], "-F", "--force", f"--socket={r}/munge/munge.socket",
                       f"--key-file={r}/munge/munge.key", f"--pid-file={r}/munge/munged.pid",
                       f"--seed-file={r}/munge/munged.seed", f"--log-file={r}/log/munged.log"],
            "slurmctld": [BINARIES["slurmctld"], "-D", "-c", "-i", "-f", str(self.conf)],
            "slurmd": [BINARIES["slurmd"], "-D", "-f", str(self.conf)],
        }

    def _recorded(self) -> dict[str, int]:
        try:
            return {k: int(v) for k, v in json.loads(self.state_file.read_text()).items()}
        except (FileNotFoundError, ValueError):
            return {}

    def _is_ours(self, name: str, pid: int) -> bool:
        return _is_ours(BINARIES[name], self.root, pid)

    def alive(self) -> dict[str, int]:
        return {n: p for n, p in self._recorded().items() if self._is_ours(n, p)}

    def node_state(self) -> str:
        out = subprocess.run(["sinfo", "-h", "-N", "-o", "%t"], capture_output=True, text=True,
                             env=self.env(), timeout=20)
        return out.stdout.strip() if out.returncode == 0 else f"error: {out.stderr.strip()}"

    def start(self, timeout_s: float = 60.0) -> bool:
        """Start the cluster, or reuse a running one under `root`; True if this call started it."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / "lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            alive = self.alive()
            if alive and len(alive) == len(DAEMONS) and not self._conf_is_current():
                print(f"slurm.conf under {self.root} is outdated: restarting the daemons", file=sys.stderr)
                self.stop()
                alive = {}
            if alive and len(alive) == len(DAEMONS):
                if self.wait_idle(timeout_s):
                    return False
                raise ClusterError(f"daemons {alive} under {self.root} run but the node is not idle "
                                   f"({self.node_state()}); run `python {__file__} stop` and retry")
            if alive:  # a half-dead cluster of ours: stop what is left, start fresh
                self._stop_pids(alive)
            install_if_missing()
            self._write_files()
            pids: dict[str, int] = {}
            for name, cmd in self._commands().items():
                with open(self.root / "log" / f"{name}.stdout", "ab") as log:
                    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, start_new_session=True)
                pids[name] = proc.pid
                self.state_file.write_text(json.dumps(pids))
                if name == "munged":
                    self._wait_for(lambda: (self.root / "munge" / "munge.socket").exists(), 10, proc)
                if name == "slurmctld":
                    self._wait_for(lambda: not self.node_state().startswith("error"), 20, proc)
            if not self.wait_idle(timeout_s):
                raise ClusterError(f"node not idle after {timeout_s}s ({self.node_state()}); "
                                   f"see {self.root}/log/")
            return True

    def _wait_for(self, ready, timeout_s: float, proc: subprocess.Popen) -> None:
        wait_until(ready, timeout_s, proc, self.root)

    def wait_idle(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            state = self.node_state()
            if state in ("idle", "mix", "alloc"):
                return True
            if state in ("drain", "drng", "down", "down*") or "drain" in state:
                subprocess.run(["scontrol", "update", "nodename=ALL", "state=resume"],
                               env=self.env(), capture_output=True)
            time.sleep(0.3)
        return False

    def stop(self, timeout_s: float = 15.0) -> None:
        """Cancel this cluster's jobs, then stop exactly the daemons recorded in daemons.json."""
        alive = self.alive()
        if {"slurmctld", "slurmd"} <= alive.keys():
            jobs = subprocess.run(["squeue", "-h", "-o", "%A"], env=self.env(), capture_output=True,
                                  text=True, timeout=20).stdout.split()
            if jobs:
                subprocess.run(["scancel", *jobs], env=self.env(), capture_output=True, timeout=20)
            deadline = time.monotonic() + timeout_s
            while time.monotonic() < deadline and subprocess.run(
                    ["squeue", "-h", "-t", "R,CG"], env=self.env(), capture_output=True,
                    text=True, timeout=20).stdout.strip():
                time.sleep(0.5)
        self._stop_pids(alive, timeout_s)
        self.state_file.unlink(missing_ok=True)

    def _stop_pids(self, pids: dict[str, int], timeout_s: float = 15.0) -> None:
        for name in reversed(DAEMONS):
            if name in pids:
                _terminate(pids[name], lambda: self._is_ours(name, pids[name]), timeout_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=["start", "stop", "status", "env"])
    parser.add_argument("--root", type=Path, default=DEFAULT_ROOT)
    parser.add_argument("--timeout", type=float, default=60.0)
    args = parser.parse_args(argv)
    cluster = LocalCluster(args.root.resolve())
    try:
        if args.action == "start":
            started = cluster.start(args.timeout)
            print(f"{'started' if started else 'reusing'} local Slurm cluster under {cluster.root} "
                  f"({cluster.alive()}); node {cluster.node_state()}", file=sys.stderr)
            print(f"export SLURM_CONF={cluster.conf}")
        elif args.action == "stop":
            alive = cluster.alive()
            cluster.stop()
            print(f"stopped {alive or 'nothing (no daemons of ours running)'}", file=sys.stderr)
        elif args.action == "status":
            alive = cluster.alive()
            print(json.dumps({"root": str(cluster.root), "daemons": alive,
                              "node": cluster.node_state() if alive else "down"}))
            return 0 if len(alive) == len(DAEMONS) else 1
        else:
            print(f"export SLURM_CONF={cluster.conf}")
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
