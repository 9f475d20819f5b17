"""Where this process sits in the job: rank information from torchrun, Slurm or nothing.

`detect_env` reads an environment mapping (never mutates it) and returns a frozen `DistEnv`;
`init_process_group` turns that into a torch.distributed default group. Precedence:
torchrun variables (RANK/WORLD_SIZE/...) > a Slurm step (`srun` without torchrun) > one process.
"""

from __future__ import annotations

import datetime
import os
import re
import secrets
import socket
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

Launcher = Literal["torchrun", "slurm", "single"]

# Port used by a Slurm step without MASTER_PORT: stable per job (so a requeued job reuses it)
# and spread over a range so two jobs sharing a head node rarely collide. The range ends below Linux's default
# ephemeral ports (net.ipv4.ip_local_port_range 32768-60999): a port there, found free, can be handed to an
# outgoing connection (an NFS mount, a dataloader's fetch) before torchrun binds it (was 20000-39999).
_PORT_BASE = 20000
_PORT_SPAN = 12768
_PORT_STRIDE = 7919  # free_master_port's step past a taken port: a prime, so every port of the span comes round


@dataclass(frozen=True)
class DistEnv:
    """Rank layout of one process; `master_port == 0` means "any free local port"."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    node_rank: int
    master_addr: str
    master_port: int
    launcher: Launcher = "single"

    def __post_init__(self) -> None:
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in [0, world_size={self.world_size})")
        if self.local_world_size < 1 or not 0 <= self.local_rank < self.local_world_size:
            raise ValueError(
                f"local_rank {self.local_rank} is not in [0, local_world_size={self.local_world_size})"
            )
        if self.node_rank < 0 or not 0 <= self.master_port < 65536:
            raise ValueError(f"bad node_rank {self.node_rank} or master_port {self.master_port}")

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def unique_suffix() -> str:
    """host-pid-random for a temporary file name: unique across hosts that share a filesystem (containers on
    different hosts share pids; NFS shares the directory) and across retries of one process."""
    return f"{host_name()}-{os.getpid()}-{secrets.token_hex(4)}"


def host_name() -> str:
    """This host's name as ``unique_suffix`` writes it (safe in a file name)."""
    return re.sub(r"[^A-Za-z0-9_.-]", "_", socket.gethostname())[:64] or "host"


def single_process_env() -> DistEnv:
    return DistEnv(
        rank=0, world_size=1, local_rank=0, local_world_size=1, node_rank=0,
        master_addr="127.0.0.1", master_port=0, launcher="single",
    )


def detect_env(environ: Mapping[str, str] = os.environ) -> DistEnv:
    """The DistEnv described by `environ`: torchrun's variables, else a Slurm step, else one process."""
    if "RANK" in environ and "WORLD_SIZE" in environ:
        return _torchrun_env(environ)
    if "SLURM_PROCID" in environ and "SLURM_STEP_ID" in environ:
        return _slurm_env(environ)
    return single_process_env()


def _int(environ: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = environ.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ValueError(f"environment variable {name} is required here but not set")
        return default
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} is not an integer") from None


def _torchrun_env(environ: Mapping[str, str]) -> DistEnv:
    world_size = _int(environ, "WORLD_SIZE")
    local_world_size = _int(environ, "LOCAL_WORLD_SIZE", 1)
    rank = _int(environ, "RANK")
    if world_size > 1 and "MASTER_ADDR" not in environ:
        raise ValueError("RANK/WORLD_SIZE are set but MASTER_ADDR is not: launch with torchrun, "
                         "or set MASTER_ADDR and MASTER_PORT")
    return DistEnv(
        rank=rank,
        world_size=world_size,
        local_rank=_int(environ, "LOCAL_RANK", 0),
        local_world_size=local_world_size,
        node_rank=_int(environ, "GROUP_RANK", rank // local_world_size),
        master_addr=environ.get("MASTER_ADDR", "127.0.0.1"),
        master_port=_int(environ, "MASTER_PORT", 0),
        launcher="torchrun",
    )


def _slurm_env(environ: Mapping[str, str]) -> DistEnv:
    """One process per Slurm task (`srun python -m pretrain.train ...`, no torchrun)."""
    world_size = _int(environ, "SLURM_STEP_NUM_TASKS", _int(environ, "SLURM_NTASKS", 1))
    node_rank = _int(environ, "SLURM_NODEID", 0)
    per_node = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE")
    local_world_size = 1
    if per_node:
        counts = parse_tasks_per_node(per_node)
        if node_rank >= len(counts):
            raise ValueError(f"SLURM_NODEID={node_rank} but tasks-per-node {per_node!r} lists "
                             f"{len(counts)} nodes")
        local_world_size = counts[node_rank]
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST", "")
    master_addr = environ.get("MASTER_ADDR") or (
        parse_hostlist(nodelist)[0] if nodelist else "127.0.0.1")
    job_id = _int(environ, "SLURM_JOB_ID", 0)
    return DistEnv(
        rank=_int(environ, "SLURM_PROCID"),
        world_size=world_size,
        local_rank=_int(environ, "SLURM_LOCALID", 0),
        local_world_size=local_world_size,
        node_rank=node_rank,
        master_addr=master_addr,
        master_port=_int(environ, "MASTER_PORT", default_master_port(job_id)),
        launcher="slurm",
    )


def default_master_port(job_id: int) -> int:
    """The rendezvous port for a Slurm job, the same in every task and after a requeue."""
    return _PORT_BASE + job_id % _PORT_SPAN


def port_is_free(port: int) -> bool:
    """Whether nothing on this host listens on ``port`` (bound with SO_REUSEADDR, as the rendezvous store binds: a
    port in TIME_WAIT counts as free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("", port))
        except OSError:
            return False
    return True


def free_master_port(start: int, tries: int = 64) -> int:
    """``start`` when nothing on this host listens on it, else the first free one of ``start + k * _PORT_STRIDE``
    (wrapping within the job-port range). The batch script takes it on the head node: job ids ``_PORT_SPAN`` apart
    share ``default_master_port``, and the second job would fail at its rendezvous. The stride, not ``start + 1``,
    because the next job id's port is ``start + 1`` (found on the cluster test: the neighbour job failed). A port
    left in TIME_WAIT by this job's previous attempt counts as free (the rendezvous store binds with SO_REUSEADDR,
    as this probe does)."""
    for k in range(tries):
        port = _PORT_BASE + (start - _PORT_BASE + k * _PORT_STRIDE) % _PORT_SPAN
        if port_is_free(port):
            return port
    raise RuntimeError(f"no free port among {tries} tried from {start} on this host; set MASTER_PORT to a free one")


def _split_top_level(text: str) -> list[str]:
    """Split on commas outside brackets: "a[1,2],b" -> ["a[1,2]", "b"]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError(f"unbalanced ']' in Slurm hostlist {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ValueError(f"unbalanced '[' in Slurm hostlist {text!r}")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_range(body: str, hostlist: str) -> list[str]:
    """"01-03,7" -> ["01", "02", "03", "7"]; zero padding follows the lower bound."""
    out = []
    for item in body.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if m is None:
            raise ValueError(f"bad range {item!r} in Slurm hostlist {hostlist!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise ValueError(f"descending range {item!r} in Slurm hostlist {hostlist!r}")
        out.extend(str(n).zfill(len(lo)) for n in range(int(lo), int(hi) + 1))
    return out


def _expand_host(pattern: str, hostlist: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", pattern)
    if m is None:
        return [pattern]
    head, tail = pattern[: m.start()], pattern[m.end():]
    return [head + v + rest for v in _expand_range(m.group(1), hostlist)
            for rest in _expand_host(tail, hostlist)]


def parse_hostlist(hostlist: str) -> list[str]:
    """Expand a Slurm hostlist like "gpu[01-03,7],login-a" in order (what `scontrol show hostnames` does)."""
    hosts = [h for part in _split_top_level(hostlist.strip()) for h in _expand_host(part, hostlist)]
    if not hosts:
        raise ValueError(f"empty Slurm hostlist {hostlist!r}")
    return hosts


def parse_tasks_per_node(spec: str) -> list[int]:
    """Expand SLURM_TASKS_PER_NODE, e.g. "2(x3),1" -> [2, 2, 2, 1]."""
    counts = []
    for item in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", item.strip())
        if m is None:
            raise ValueError(f"bad tasks-per-node spec {spec!r} (expected e.g. '2(x3),1')")
        counts.extend([int(m.group(1))] * int(m.group(2) or 1))
    return counts


def resolve_backend(backend: str) -> str:
    """"auto" -> "nccl" when CUDA is available, else "gloo"."""
    import torch

    if backend == "auto":
        return "nccl" if torch.cuda.is_available() else "gloo"
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"distributed backend must be auto, gloo or nccl, got {backend!r}")
    return backend


def cuda_device_index(env: DistEnv) -> int:
    """The CUDA device (index among the visible ones) of this rank: ``cuda:<local rank>`` when the process sees the
    node's GPUs (torchrun; srun with --gpus-per-node), ``cuda:0`` when the launcher narrowed CUDA_VISIBLE_DEVICES to
    this task's one GPU (srun --gpus-per-task=1, --gpu-bind=single:1): there cuda:<local rank> does not exist."""
    import torch

    visible = torch.cuda.device_count()
    if env.local_rank < visible:
        return env.local_rank
    if visible == 1:
        return 0
    raise ValueError(f"local rank {env.local_rank} of {env.local_world_size} on this node but this process sees "
                     f"{visible} CUDA device(s) (CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}): "
                     f"give each rank its own GPU (one per local rank, or exactly one per task)")


_LAUNCH_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What the Engine (for DeepSpeed, which reads them even when the group exists) and DeepSpeed itself put into
os.environ during a run; ``destroy_process_group`` puts them back as ``init_process_group`` found them."""
_launch_vars_before: dict[str, str | None] | None = None


def init_process_group(env: DistEnv, *, backend: str, timeout_s: int) -> None:
    """Create the default process group for `env` (also for one process: DeepSpeed needs a group).

    torchrun workers join the agent's store (env://); Slurm tasks meet at master_addr:master_port
    with rank 0 hosting the store; a single process gets a private store on a free local port.
    """
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        if dist.get_world_size() != env.world_size or dist.get_rank() != env.rank:
            raise ValueError(f"a process group already exists with rank {dist.get_rank()}/"
                             f"{dist.get_world_size()}, but the environment says {env.rank}/{env.world_size}")
        return
    global _launch_vars_before
    _launch_vars_before = {k: os.environ.get(k) for k in _LAUNCH_VARS}
    _forget_deepspeed_groups()
    backend = resolve_backend(backend)
    timeout = datetime.timedelta(seconds=timeout_s)
    kwargs: dict = {}
    if backend == "nccl":
        device = cuda_device_index(env)
        torch.cuda.set_device(device)
        kwargs["device_id"] = torch.device("cuda", device)
    if env.launcher == "torchrun":
        # torchrun's contract: MASTER_ADDR/PORT and TORCHELASTIC_USE_AGENT_STORE are in os.environ.
        dist.init_process_group(backend, init_method="env://", rank=env.rank,
                                world_size=env.world_size, timeout=timeout, **kwargs)
    elif env.world_size == 1:
        store = dist.TCPStore("127.0.0.1", env.master_port, 1, is_master=True, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=0, world_size=1, timeout=timeout, **kwargs)
    else:
        store = dist.TCPStore(env.master_addr, env.master_port, env.world_size,
                              is_master=env.rank == 0, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=env.rank, world_size=env.world_size,
                                timeout=timeout, **kwargs)


def _forget_deepspeed_groups() -> None:
    """Drops the sub-groups DeepSpeed cached of an earlier default group (its world clone, data-parallel and ZeRO
    groups), however that group was torn down. A new group is otherwise handed them, and ``deepspeed.initialize``
    fails ("Group ... is not registered"): a second run in one Python process (a sweep, a notebook, the tests).
    DeepSpeed is not imported here: its cache is dropped only where it is loaded."""
    groups = sys.modules.get("deepspeed.utils.groups")
    release = getattr(groups, "_release_process_group_references", None)  # DeepSpeed 0.19 (pyproject's pin)
    if release is not None:
        release(None)


def destroy_process_group() -> None:
    """Tear down the default group if there is one (safe to call twice). The launcher variables the run put into
    os.environ (``_LAUNCH_VARS``) are put back as ``init_process_group`` found them, so that a later run in one
    process does not take them for a launcher's."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    global _launch_vars_before
    for key, value in (_launch_vars_before or {}).items():  # a later run must not read this one's rank as a launch
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    _launch_vars_before = None


def job_id(environ=os.environ) -> str:
    """This process's job: Slurm's ``<array job>_<task>`` or job id, else ``PRETRAIN_JOB_ID`` (other schedulers
    set it to an id that a restart of the same job keeps); '' when none is known."""
    if environ.get("SLURM_ARRAY_JOB_ID") and environ.get("SLURM_ARRAY_TASK_ID"):
        return f"slurm:{environ['SLURM_ARRAY_JOB_ID']}_{environ['SLURM_ARRAY_TASK_ID']}"
    if environ.get("SLURM_JOB_ID"):
        return f"slurm:{environ['SLURM_JOB_ID']}"
    return environ.get("PRETRAIN_JOB_ID", "")


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists on this host (one owned by another user counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    return True


if __name__ == "__main__":  # slurm/pretrain.sbatch: python -m pretrain.distributed.env --free-port START
    if len(sys.argv) != 3 or sys.argv[1] not in ("--free-port", "--job-port", "--check-port"):
        sys.exit("usage: python -m pretrain.distributed.env --free-port START | --job-port JOB_ID | --check-port PORT")
    arg = int(sys.argv[2])
    if sys.argv[1] == "--check-port":  # exit 0 when free here, 1 when something listens on it
        sys.exit(0 if port_is_free(arg) else 1)
    print(free_master_port(arg) if sys.argv[1] == "--free-port" else default_master_port(arg))
