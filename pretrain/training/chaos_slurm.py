"""The chaos soak's Slurm mode: every launch is one attempt of the same ``sbatch slurm/pretrain.sbatch`` job on the
network-namespace Slurm cluster of ``tests/slurm/netns.py`` (loaded from this checkout's tests/ by
:func:`load_netns`, the way tests/integration/test_slurm_multinode.py loads it: tests/ is not a package), the faults
delivered the way Slurm delivers them. ``SlurmJob`` has the interface of ``chaos_job.Job``, so the soak's loop
(``chaos_soak.Soak``) is the same in both modes.

Between launches the job is held (``scontrol hold`` when it requeued itself or Slurm requeued it,
``scontrol requeuehold`` when it ended), so the soak can damage checkpoints while nothing runs; the next launch
releases it: the same job id, so the trainer takes the run lock over at once as a real requeue does.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from pretrain.training.chaos_job import REPO, _ppid, _signal, descendants, kill_first

SBATCH = REPO / "slurm" / "pretrain.sbatch"
FINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
         "PREEMPTED"}
FULL_TERM = ("the scancel --full variant: SIGTERM to the batch step too (as a cancel, preemption or time limit sends "
             "it) reaches srun, which then SIGKILLs the tasks at once (srun: forcing job termination): the "
             "ranks cannot checkpoint, so that variant is a SIGKILL of the job, not a graceful stop")
"""Why ``sigterm`` is delivered to the steps only (found by the first Slurm soak; see docs/operations.md)."""
QUARANTINE_S = 90.0
"""A node set DOWN after ``kill_node`` is brought back at once but kept out of the job (ExcNodeList) this long:
slurmctld retries the terminate request of the attempt lost with the node about a minute later, and on a node
running the same job id again it SIGTERMs, then SIGKILLs, the new attempt's tasks (found by the 8-minute soaks)."""
POLL_S = 0.5
"""How often the job's state is asked of slurmctld (each ask is a process and an RPC: not every 20 ms)."""
SETTLE_S = 12.0
"""A job's next attempt starts this long (KillWait + 2 s) after its last one ended, as Slurm itself delays a requeued
job (by 10 s), which the soak's ``StartTime=now`` would skip. Released in the same second, the attempt died at once:
"Killing non-startable batch job: Job credential revoked" (slurmd revokes the last attempt's credential, of the same
job id, with a whole-second time stamp; found by the first 8-minute soak)."""


def load_netns():
    """tests/slurm/netns.py of this checkout as a module (the cluster harness lives with the tests)."""
    name = "slurm_netns"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "tests" / "slurm" / "netns.py")
        sys.modules[name] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    return sys.modules[name]


def job_info(cluster, job_id: str) -> dict:
    """``scontrol show job -o``'s fields ({} when slurmctld does not answer)."""
    out = cluster.run(["scontrol", "show", "job", "-o", job_id]).stdout
    return dict(re.findall(r"(\w+)=(\S*)", out))


def _checked(cluster, argv: list[str], env: dict | None = None) -> str:
    """``argv`` run on the cluster; its stdout, or RuntimeError naming the command and its stderr."""
    proc = cluster.run(argv, env=env)
    if proc.returncode != 0:
        raise RuntimeError(f"chaos: {' '.join(argv)} failed: {proc.stderr.strip()}")
    return proc.stdout


def _scontrol(cluster, *argv: str) -> None:
    _checked(cluster, ["scontrol", *argv])


def job_pids(job_id: str, node: int | None = None) -> list[int]:
    """Live processes of Slurm job ``job_id`` (whose environment names it), on its ``node``-th node if given. The
    nodes' network namespaces share this machine's PID space."""
    want = f"SLURM_JOB_ID={job_id}".encode()
    out = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            environ = (proc / "environ").read_bytes().split(b"\0")
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if want in environ and state != "Z" and (node is None or f"SLURM_NODEID={node}".encode() in environ):
            out.append(int(proc.name))
    return out


def _argv(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


class SlurmLauncher:
    """Starts the soak's launches on ``cluster`` (a NetnsCluster): ``launch`` the attempts of one job,
    ``reference`` a job of its own. ``open`` starts the cluster (after the soak mounted its tmpfs: each node's
    daemons copy the mount table when they start), ``close`` stops it."""

    def __init__(self, cluster, *, nodes: int, nproc: int, config: Path):
        self.cluster, self.nodes, self.nproc, self.config = cluster, nodes, nproc, Path(config)
        self.job_id: str | None = None
        self.ended_wall = 0.0
        self.down_at: dict[str, float] = {}
        """Nodes the soak set DOWN, with time.monotonic() then (see QUARANTINE_S)."""
        """time.time() when the last attempt was seen over (see SETTLE_S)."""
        self.not_injected = [("sigterm", FULL_TERM)]
        """Fault variants the soak lists as not injected, with why."""

    def open(self) -> None:
        self.config.write_text("# the chaos soak's trainer config: everything is in its key=value overrides\n")
        self.cluster.start(timeout_s=60)

    def close(self) -> None:
        self.cluster.stop()

    def launch(self, overrides: list[str], *, log_dir: Path, name: str, env: dict) -> SlurmJob:
        job = SlurmJob(self, overrides, out=Path(log_dir) / "soak-job.out", env=env, job_id=self.job_id)
        self.job_id = job.job_id
        return job

    def reference(self, overrides: list[str], *, log_dir: Path, name: str, env: dict) -> SlurmJob:
        return SlurmJob(self, overrides, out=Path(log_dir) / f"{name}-job.out", env=env, job_id=None)


class SlurmJob:
    """One attempt of the soak's Slurm job: submitted (``job_id`` None) or released from its hold (the previous
    attempt's job, requeued held first if it had ended). Nodes are the job's node indices (SLURM_NODEID); output
    is what the attempt appended to the job's output file."""

    def __init__(self, launcher: SlurmLauncher, overrides: list[str], *, out: Path, env: dict,
                 job_id: str | None):
        self.launcher, self.cluster, self.nodes = launcher, launcher.cluster, launcher.nodes
        self.logs = [Path(out)]
        self.offset = self.logs[0].stat().st_size if self.logs[0].is_file() else 0
        self.killed_node: str | None = None
        self.ended_at: float | None = None
        self.info: dict = {}
        self._agents: dict[int, int] = {}
        self._asked = self._scanned = 0.0
        if job_id is None:
            self.job_id = self._submit(launcher, overrides, env)
        else:
            self.job_id = job_id
            self._release()
        self.restarts = int(self._poll(force=True).get("Restarts", 0))

    def _submit(self, launcher: SlurmLauncher, overrides: list[str], env: dict) -> str:
        env = {k: v for k, v in env.items() if not k.startswith("SLURM_")}
        env |= {"GPUS_PER_NODE": str(launcher.nproc), "MAX_REQUEUES": "100000"}
        run_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("run_dir="))
        argv = ["sbatch", "--parsable", f"--nodes={self.nodes}", f"--output={self.logs[0]}", f"--chdir={REPO}",
                "--job-name=chaos-soak", str(SBATCH), run_dir, str(launcher.config), *overrides]
        return _checked(self.cluster, argv, env).strip().split(";")[0]

    def _release(self) -> None:
        """Start the next attempt now: requeue the ended job held, drop the requeue's start delay, release it."""
        info = self._poll(force=True)
        time.sleep(max(0.0, self.launcher.ended_wall + SETTLE_S - time.time()))
        if info.get("JobState") in FINAL:
            _scontrol(self.cluster, "requeuehold", self.job_id)
        _scontrol(self.cluster, "update", f"JobId={self.job_id}", f"ExcNodeList={','.join(self._quarantined())}")
        _scontrol(self.cluster, "update", f"JobId={self.job_id}", "StartTime=now")
        _scontrol(self.cluster, "release", self.job_id)

    def _quarantined(self) -> list[str]:
        """Nodes set DOWN less than QUARANTINE_S ago; waits for the oldest to come out when too few are left."""
        while True:
            now = time.monotonic()
            fresh = {n: t for n, t in self.launcher.down_at.items() if now - t < QUARANTINE_S}
            if self.cluster.num_nodes - len(fresh) >= self.nodes:
                return sorted(fresh)
            time.sleep(QUARANTINE_S - (now - min(fresh.values())) + 0.1)

    # ------------------------------------------------------------------------------------- state

    def _poll(self, force: bool = False) -> dict:
        if force or time.monotonic() - self._asked >= POLL_S:
            self._asked = time.monotonic()
            self.info = job_info(self.cluster, self.job_id) or self.info
        return self.info

    def _attempt_over(self) -> bool:
        """This attempt is over: the job requeued (Restarts went up) or reached a final state."""
        info = self._poll()
        return int(info.get("Restarts", self.restarts)) > self.restarts or info.get("JobState") in FINAL

    def agent(self, node: int) -> int | None:
        """The torchrun agent (pretrain.distributed.launch) of the job's ``node``-th node, once it is there."""
        pid = self._agents.get(node)
        if pid is None:
            for p in job_pids(self.job_id, node):
                argv = _argv(p)  # python -m pretrain.distributed.launch (not srun or bash naming it in a script)
                if argv[:1] and Path(argv[0]).name.startswith("python") and "pretrain.distributed.launch" in argv:
                    self._agents[node] = pid = p
                    break
        return pid

    def running(self) -> list[int]:
        """Nodes whose agent has not exited; every node while the attempt is still starting (its agents are
        looked for at the polling rate: a scan of /proc)."""
        if self.ended_at is not None or self._attempt_over():
            return []
        if len(self._agents) < self.nodes and time.monotonic() - self._scanned >= POLL_S:
            self._scanned = time.monotonic()
            for node in range(self.nodes):
                self.agent(node)
        if len(self._agents) < self.nodes:
            return list(range(self.nodes))
        return [n for n, pid in sorted(self._agents.items()) if _state(pid) not in ("Z", "X")]

    def codes(self) -> list[int | None]:
        """The batch script's exit code (one entry: Slurm records no per-node code), None while it runs; a job
        killed by a signal or lost with a node: minus the signal, or -1."""
        info = self.info if self.ended_at is not None else self._poll()
        if self.ended_at is None:
            return [None]
        rc, sig = (int(x) for x in info.get("ExitCode", "0:0").split(":"))
        if info.get("JobState") in ("COMPLETED",) and rc == 0 and sig == 0:
            return [0]
        return [-sig if sig else (rc if rc else -1)]

    def exited_with(self, code: int) -> bool:
        """A task (torchrun) exited with ``code``: srun names it even when --kill-on-bad-exit then ended the other
        node's task with SIGTERM, whose 143 becomes the job's exit code."""
        return self.codes()[0] == code or f"Exited with exit code {code}\n" in self.output()

    def exit_text(self) -> str:
        """The job's state after this attempt, e.g. 'job 1 FAILED exit 75:0' or 'job 1 requeued by Slurm or its
        script (restart 3), held'."""
        info = self.info
        if int(info.get("Restarts", self.restarts)) > self.restarts:
            return f"job {self.job_id} requeued by Slurm or its script (restart {info['Restarts']}), held"
        return f"job {self.job_id} {info.get('JobState', '?')} exit {info.get('ExitCode', '?')}"

    # ------------------------------------------------------------------------------------- faults

    def workers(self, node: int) -> list[int]:
        agent = self.agent(node)
        return [] if agent is None else [p for p in descendants(agent) if _ppid(p) == agent]

    def kill_worker(self, node: int) -> int | None:
        """SIGKILL one worker (a rank) of the job's ``node``-th node; its pid, or None when it has none."""
        return kill_first(self.workers(node))

    def signal_job(self, sig: int) -> None:
        """SIGUSR1 as Slurm sends it before the time limit (``--signal=B:USR1@N``, here ``scancel --batch``: to the
        batch shell, which forwards it to the steps and requeues the job). SIGTERM with ``scancel --signal=TERM``:
        to every process of the job's steps (torchrun and the ranks), not to the batch shell and its srun (see
        FULL_TERM)."""
        argv = (["scancel", "--batch", "--signal=USR1", self.job_id] if sig == signal.SIGUSR1
                else ["scancel", f"--signal={signal.Signals(sig).name[3:]}", self.job_id])
        _checked(self.cluster, argv)

    def kill_node(self, node: int) -> None:
        """Lose the job's ``node``-th node as in a crash (NetnsCluster.kill_node: frozen, cable pulled, slurmd and
        every task SIGKILLed). ``wait`` then marks it DOWN once the job's processes are gone and revives it; the
        next attempts keep off it for QUARANTINE_S."""
        names = self.cluster.run(["scontrol", "show", "hostnames", self._poll(force=True)["NodeList"]]).stdout
        self.killed_node = names.split()[node]
        self.cluster.kill_node(self.killed_node)

    def wait(self, timeout_s: float) -> bool:
        """The attempt ended within ``timeout_s``; then the job is held, so nothing runs until the next launch."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.killed_node and self.ended_at is None and not job_pids(self.job_id):
                self.ended_at = time.monotonic()  # Slurm learns of the lost node only at SlurmdTimeout: say so
                _scontrol(self.cluster, "update", f"NodeName={self.killed_node}", "State=DOWN",
                          "Reason=chaos-soak-killed")
                self.launcher.down_at[self.killed_node] = time.monotonic()
            if self._attempt_over():
                break
            time.sleep(POLL_S / 5)
        else:
            return False
        self.ended_at = self.ended_at or time.monotonic()
        info = self._poll(force=True)
        while info.get("JobState") not in FINAL | {"PENDING"} and time.monotonic() < deadline + 60:
            time.sleep(POLL_S)  # COMPLETING: a requeue is done only once the steps are cleaned up
            info = self._poll(force=True)
        self.launcher.ended_wall = time.time()
        if info.get("JobState") not in FINAL:  # requeued (by the batch script or Slurm): hold it
            _scontrol(self.cluster, "hold", self.job_id)
        if self.killed_node:
            self.cluster.revive_node(self.killed_node)
        return True

    def kill_all(self) -> None:
        """The attempt did not end: cancel nothing of Slurm's, SIGKILL every process of the job (as KillWait)."""
        _signal(job_pids(self.job_id), signal.SIGKILL)
        self.wait(60)

    def output(self) -> str:
        if not self.logs[0].is_file():
            return ""
        with open(self.logs[0], "rb") as f:
            f.seek(self.offset)
            return f.read().decode(errors="replace")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "X"


def build_cluster(nodes: int):
    """A NetnsCluster (not started) of ``nodes`` + 1 nodes: a job requeued after a node loss finds a spare while
    the lost node is brought back. Its root is a short new directory under /tmp (slurmstepd's unix sockets live in
    its spool: 108-byte paths). Raises the harness's NetnsUnavailable / SlurmUnavailable at ``open``."""
    root = Path(tempfile.mkdtemp(prefix="pt-soak-", dir="/tmp"))
    return load_netns().NetnsCluster(root, num_nodes=nodes + 1)


def remove_cluster(cluster, keep_logs: Path) -> None:
    """Stop what is left of ``cluster``, keep its daemons' logs in ``keep_logs``, delete its directory."""
    cluster.stop()
    if (cluster.root / "log").is_dir():
        shutil.copytree(cluster.root / "log", keep_logs, dirs_exist_ok=True)
    shutil.rmtree(cluster.root, ignore_errors=True)
