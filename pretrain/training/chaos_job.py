"""The chaos soak's processes and filesystem faults: a job of N torchrun agents ("nodes") on loopback, each with its
workers, signalled and killed the way a cluster does it; a small tmpfs for the run directory and a filler that
takes its last byte; the newest checkpoint truncated or bit-flipped. Used by ``chaos_soak.py``."""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pretrain

REPO = Path(pretrain.__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (read from /proc), children first. torchrun starts each worker in a session
    of its own, so a process group does not hold a node's processes: its tree does."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            stat = (entry / "stat").read_text()
            children.setdefault(int(stat[stat.rindex(")") + 2:].split()[1]), []).append(int(entry.name))
        except (OSError, ValueError, IndexError):
            continue
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop(0)
        out.append(p)
        todo += children.get(p, [])
    return out


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def kill_first(pids: list[int]) -> int | None:
    """SIGKILL the first of ``pids``; its pid, or None when there is none."""
    if pids:
        _signal(pids[:1], signal.SIGKILL)
    return pids[0] if pids else None


def worker_env(job_id: str) -> dict:
    """The environment of every launch: this checkout first on the path, one thread, CPU DeepSpeed, a fixed job
    id (a relaunch takes over the run lock at once, as a Slurm requeue does), no launcher variables inherited."""
    env = dict(os.environ, OMP_NUM_THREADS="1", DS_ACCELERATOR="cpu", PYTHONUNBUFFERED="1",
               PRETRAIN_JOB_ID=job_id)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
              "TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "SLURM_JOBID", "SLURM_ARRAY_JOB_ID"):
        env.pop(k, None)
    return env


class Job:
    """One launch of the trainer: ``nodes`` torchrun agents (static rendezvous on 127.0.0.1) of ``nproc`` workers
    each, every agent started as the Slurm script starts it (``trap "" USR1; exec python -m
    pretrain.distributed.launch ...``: torchrun ignores USR1, its workers handle it). Output: one log per node."""

    def __init__(self, overrides: list[str], *, log_dir: Path, name: str, env: dict, nodes: int = 2,
                 nproc: int = 1):
        port = free_port()
        self.logs = [Path(log_dir) / f"{name}_node{n}.log" for n in range(nodes)]
        self.procs = []
        for node, log in enumerate(self.logs):
            cmd = ["bash", "-c", 'trap "" USR1; exec "$@"', "node", sys.executable, "-m",
                   "pretrain.distributed.launch", "--nnodes", str(nodes), "--node-rank", str(node),
                   "--nproc-per-node", str(nproc), "--master-addr", "127.0.0.1", "--master-port", str(port),
                   "-m", "pretrain.train", *overrides]
            with open(log, "w") as out:
                self.procs.append(subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                                   start_new_session=True))

    def running(self) -> list[int]:
        """Nodes whose agent has not exited."""
        return [n for n, p in enumerate(self.procs) if p.poll() is None]

    def codes(self) -> list[int | None]:
        return [p.poll() for p in self.procs]

    def exited_with(self, code: int) -> bool:
        """The first node's agent (rank 0's) exited with ``code``."""
        return self.codes()[0] == code

    def exit_text(self) -> str:
        return "agents exit " + "/".join(str(c) for c in self.codes())

    def node_pids(self, node: int) -> list[int]:
        """The agent of ``node`` and all its descendants (workers, their DataLoader workers)."""
        agent = self.procs[node].pid
        return [*descendants(agent), agent] if self.procs[node].poll() is None else descendants(agent)

    def workers(self, node: int) -> list[int]:
        """The worker processes of ``node`` (the agent's children)."""
        agent = self.procs[node].pid
        return [p for p in descendants(agent) if _ppid(p) == agent]

    def signal_job(self, sig: int) -> None:
        """``sig`` to every process of the job, as Slurm signals every process of a job step."""
        _signal([p for n in range(len(self.procs)) for p in self.node_pids(n)], sig)

    def kill_node(self, node: int) -> None:
        """The node dies: SIGKILL its agent and every process under it, at once."""
        _signal(self.node_pids(node), signal.SIGKILL)

    def kill_worker(self, node: int) -> int | None:
        """SIGKILL one worker of ``node``; its pid, or None when it has none."""
        return kill_first(self.workers(node))

    def wait(self, timeout_s: float) -> bool:
        """Every agent exited within ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while self.running() and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self.running()

    def kill_all(self) -> None:
        for n in range(len(self.procs)):
            self.kill_node(n)
        for p in self.procs:
            p.wait()

    def output(self) -> str:
        return "\n".join(log.read_text(errors="replace") for log in self.logs if log.is_file())


class TorchrunLauncher:
    """The soak's launches as ``Job``s on this machine (the torchrun mode); ``open``/``close`` have nothing to do."""

    def __init__(self, *, nodes: int, nproc: int):
        self.nodes, self.nproc = nodes, nproc
        self.not_injected: list[tuple[str, str]] = []

    def open(self) -> None:
        pass

    def close(self) -> None:
        pass

    def launch(self, overrides: list[str], *, log_dir: Path, name: str, env: dict) -> Job:
        return Job(overrides, log_dir=log_dir, name=name, env=env, nodes=self.nodes, nproc=self.nproc)

    reference = launch


def _ppid(pid: int) -> int:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat[stat.rindex(")") + 2:].split()[1])
    except (OSError, ValueError, IndexError):
        return -1


class MetricsTail:
    """The last train step metrics.jsonl logged since this object was made (complete lines only)."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self.offset = self.path.stat().st_size if self.path.is_file() else 0
        self.last_step: int | None = None

    def poll(self) -> int | None:
        if not self.path.is_file():
            return self.last_step
        with open(self.path, "rb") as f:
            f.seek(self.offset)
            chunk = f.read()
        end = chunk.rfind(b"\n") + 1
        self.offset += end
        for line in chunk[:end].splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("split") == "train":
                self.last_step = rec["step"]
        return self.last_step


# ------------------------------------------------------------------------------------------- the disk


def mount_tmpfs(path: Path, size: str) -> str | None:
    """Mount a ``size`` tmpfs at ``path``; None when done, else why it could not be (the fault is then reported
    as not injected)."""
    path.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return "mounting a tmpfs needs root"
    if shutil.which("mount") is None:
        return "mount(8) is not installed"
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True,
                       text=True, check=False)
    return None if r.returncode == 0 else f"mount -t tmpfs failed: {r.stderr.strip() or r.returncode}"


def umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True, check=False).returncode != 0:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, check=False)


def fill(path: Path) -> int:
    """Take the last free byte of ``path``'s filesystem (zeros until ENOSPC, in ever smaller writes); the bytes
    written."""
    written = 0
    with open(path, "ab", buffering=0) as f:
        for size in (1 << 20, 1 << 16, 4096, 1):
            try:
                while True:
                    written += f.write(bytes(size))
            except OSError as e:
                if e.errno != errno.ENOSPC:
                    raise
    return written


# ------------------------------------------------------------------------------------------- checkpoints


def damageable_files(tag_dir: Path) -> list[Path]:
    """The checkpoint's recorded tensor files (files.json), largest first: what a truncation or a flip hits."""
    recorded = json.loads((tag_dir / "files.json").read_text(encoding="utf-8"))["files"]
    names = [n for n in recorded if n.endswith((".pt", ".safetensors"))]
    return sorted((tag_dir / n for n in names), key=lambda p: (-p.stat().st_size, p.name))


def truncate_file(path: Path, keep_frac: float) -> str:
    size = path.stat().st_size
    keep = int(size * keep_frac)
    with open(path, "r+b") as f:
        f.truncate(keep)
    return f"{path.name} truncated to {keep} of {size} bytes"


def flip_byte(path: Path, offset: int) -> str:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))
    return f"{path.name}: byte {offset} flipped"
