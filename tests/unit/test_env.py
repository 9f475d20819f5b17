"""detect_env on synthetic environments, the Slurm hostlist parser, and a world-1 process group."""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys

import pytest

from pretrain.distributed.env import (
    DistEnv,
    default_master_port,
    destroy_process_group,
    detect_env,
    free_master_port,
    init_process_group,
    parse_hostlist,
    parse_tasks_per_node,
    single_process_env,
)

TORCHRUN = {  # what torchrun exports to worker 5 of 2 nodes x 4
    "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "4", "GROUP_RANK": "1",
    "MASTER_ADDR": "gpu01", "MASTER_PORT": "29512",
}
SLURM_STEP = {  # what srun exports to task 3 of `srun -N2 -n5` (3 + 2 tasks)
    "SLURM_JOB_ID": "123456", "SLURM_STEP_ID": "0", "SLURM_PROCID": "3", "SLURM_LOCALID": "0",
    "SLURM_NODEID": "1", "SLURM_NTASKS": "5", "SLURM_STEP_NUM_TASKS": "5",
    "SLURM_STEP_TASKS_PER_NODE": "3,2", "SLURM_TASKS_PER_NODE": "3,2",
    "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_STEP_NODELIST": "gpu[07-08]",
}


def test_torchrun_env_is_read_field_by_field():
    env = detect_env(TORCHRUN)
    assert env == DistEnv(rank=5, world_size=8, local_rank=1, local_world_size=4, node_rank=1,
                          master_addr="gpu01", master_port=29512, launcher="torchrun")
    assert env.is_distributed and not env.is_main


def test_torchrun_wins_over_slurm_and_node_rank_falls_back():
    environ = {**SLURM_STEP, **TORCHRUN}
    del environ["GROUP_RANK"]
    env = detect_env(environ)
    assert env.launcher == "torchrun" and env.node_rank == 5 // 4 and env.master_addr == "gpu01"


def test_slurm_step_without_torchrun():
    env = detect_env(SLURM_STEP)
    assert env == DistEnv(rank=3, world_size=5, local_rank=0, local_world_size=2, node_rank=1,
                          master_addr="gpu07", master_port=default_master_port(123456),
                          launcher="slurm")
    assert 20000 <= env.master_port < 40000


def test_job_ports_stay_below_the_ephemeral_range():
    """Linux hands out 32768-60999 (ip_local_port_range's default) to outgoing connections: a job port there, found
    free by the batch script, could be taken before torchrun binds it. Every job's port is in 20000-32767, and the
    batch script's port is this one."""
    import subprocess
    import sys

    ports = {default_master_port(job) for job in range(0, 200_000, 7)}
    assert min(ports) >= 20000 and max(ports) < 32768, (min(ports), max(ports))
    out = subprocess.run([sys.executable, "-m", "pretrain.distributed.env", "--job-port", "123457"],
                         capture_output=True, text=True, check=True).stdout
    assert int(out) == default_master_port(123457)


def test_slurm_master_addr_and_port_can_be_given():
    env = detect_env({**SLURM_STEP, "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "1234"})
    assert (env.master_addr, env.master_port) == ("10.0.0.1", 1234)


def test_slurm_batch_shell_is_single_process():
    # The batch script itself has SLURM_PROCID=0 and SLURM_NTASKS>1 but is not a step task:
    # treating it as rank 0 of N would hang waiting for peers that never come.
    batch = {k: v for k, v in SLURM_STEP.items() if not k.startswith("SLURM_STEP")}
    batch["SLURM_PROCID"] = "0"
    assert detect_env(batch) == single_process_env()


def test_nothing_set_is_single_process():
    env = detect_env({})
    assert env == single_process_env() and env.is_main and not env.is_distributed


@pytest.mark.parametrize("environ, needle", [
    ({**TORCHRUN, "RANK": "x"}, "RANK='x'"),
    ({**TORCHRUN, "RANK": "8"}, "rank 8"),
    ({k: v for k, v in TORCHRUN.items() if k != "MASTER_ADDR"}, "MASTER_ADDR"),
    ({**SLURM_STEP, "SLURM_NODEID": "2"}, "SLURM_NODEID=2"),
    ({**SLURM_STEP, "SLURM_STEP_TASKS_PER_NODE": "3(y2)"}, "tasks-per-node"),
])
def test_bad_environments_raise_value_error(environ, needle):
    with pytest.raises(ValueError, match=needle.replace("(", r"\(")):
        detect_env(environ)


HOSTLISTS = [
    "node1",
    "node[1-3,5]",
    "gpu[01-03,7],login-a",
    "r[1-2]-n[08-10]",
    "a[9-11],b[098-101]",
    "x-[0-1],z",
]
EXPECTED = {
    "node[1-3,5]": ["node1", "node2", "node3", "node5"],
    "a[9-11],b[098-101]": ["a9", "a10", "a11", "b098", "b099", "b100", "b101"],
    "r[1-2]-n[08-10]": ["r1-n08", "r1-n09", "r1-n10", "r2-n08", "r2-n09", "r2-n10"],
}


@pytest.mark.parametrize("hostlist", HOSTLISTS)
def test_hostlist_parser(hostlist, tmp_path):
    got = parse_hostlist(hostlist)
    if hostlist in EXPECTED:
        assert got == EXPECTED[hostlist]
    if shutil.which("scontrol"):  # compare with Slurm's own expansion (needs only a config file)
        conf = tmp_path / "slurm.conf"
        conf.write_text("ClusterName=x\nSlurmctldHost=localhost\nNodeName=localhost CPUs=1\n"
                        "PartitionName=p Nodes=localhost\n")
        out = subprocess.run(["scontrol", "show", "hostnames", hostlist], capture_output=True,
                             text=True, env={"SLURM_CONF": str(conf), "PATH": "/usr/bin:/bin"})
        if out.returncode == 0:
            assert got == out.stdout.split()


@pytest.mark.parametrize("bad", ["", "n[1-2", "n1-2]", "n[3-1]", "n[a-b]"])
def test_hostlist_parser_rejects_malformed(bad):
    with pytest.raises(ValueError):
        parse_hostlist(bad)


def test_tasks_per_node():
    assert parse_tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert parse_tasks_per_node("4") == [4]


def test_default_master_port_is_stable_and_in_range():
    ports = {default_master_port(j) for j in range(0, 100000, 997)}
    assert all(20000 <= p < 32768 for p in ports) and default_master_port(7) == default_master_port(7)


def test_free_master_port_skips_a_port_another_job_listens_on():
    """Job ids 12768 apart share default_master_port; the batch script (python -m pretrain.distributed.env
    --free-port) then takes a port nothing listens on, not start + 1, which is the next job id's own port."""
    start, chain = _free_chain(3)
    busy = [socket.create_server(("", chain[k])) for k in (0, 1)]
    try:
        assert free_master_port(start) == chain[2]
        out = subprocess.run([sys.executable, "-m", "pretrain.distributed.env", "--free-port", str(start)],
                             capture_output=True, text=True, check=True)
        assert int(out.stdout) == chain[2]
    finally:
        for sock in busy:
            sock.close()
    assert free_master_port(start) == start  # free again: the job's own port, as after a requeue


def test_free_master_port_wraps_inside_the_job_port_range():
    ports = []
    for _ in range(4):
        port = free_master_port(39990)
        assert 20000 <= port < 40000
        ports.append(socket.create_server(("", port)))
    try:
        assert len({s.getsockname()[1] for s in ports}) == 4
    finally:
        for sock in ports:
            sock.close()


def _free(port: int) -> bool:
    from pretrain.distributed.env import port_is_free  # the probe the batch script's --check-port runs

    return port_is_free(port)


def _free_chain(n: int) -> tuple[int, list[int]]:
    """A start port whose first n stride steps (7919 apart, wrapping within the job ports 20000-32767) are free
    now, and those ports."""
    for start in range(21000, 23000, 7):
        chain = [20000 + (start - 20000 + k * 7919) % 12768 for k in range(n)]
        if all(_free(port) for port in chain):
            return start, chain
    pytest.skip(f"no free chain of {n} ports")


def test_init_world_one_gloo_group_works_and_destroys():
    import torch
    import torch.distributed as dist

    env = single_process_env()
    init_process_group(env, backend="gloo", timeout_s=30)
    try:
        init_process_group(env, backend="gloo", timeout_s=30)  # idempotent
        t = torch.tensor([2.0, 3.0], dtype=torch.float64)
        dist.all_reduce(t)
        assert dist.get_world_size() == 1 and t.tolist() == [2.0, 3.0]
    finally:
        destroy_process_group()
    assert not dist.is_initialized()
    destroy_process_group()  # safe twice


def test_unknown_backend_is_rejected():
    with pytest.raises(ValueError, match="gloo"):
        init_process_group(single_process_env(), backend="mpi", timeout_s=5)


def test_unique_suffix_names_host_pid_and_a_random_part():
    import os
    import socket

    from pretrain.distributed.env import unique_suffix

    a, b = unique_suffix(), unique_suffix()
    assert a != b and f"-{os.getpid()}-" in a and a.startswith(socket.gethostname()[:8].replace("/", "_"))
    assert "/" not in a


@pytest.mark.parametrize("visible, local_rank, expected", [
    (4, 3, 3),   # torchrun, or srun with the node's GPUs visible to every task: cuda:<local rank>
    (1, 3, 0),   # srun --gpus-per-task=1 / --gpu-bind: CUDA_VISIBLE_DEVICES narrowed to this task's one GPU
    (2, 1, 1),   # srun --gpus-per-task=2 with 2 tasks per node: each task sees its own 2 GPUs
])
def test_cuda_device_follows_the_gpus_this_task_can_see(monkeypatch, visible, local_rank, expected):
    import torch
    import torch.distributed as dist

    from pretrain.distributed import env as env_mod

    env = detect_env({**SLURM_STEP, "SLURM_LOCALID": str(local_rank), "SLURM_STEP_TASKS_PER_NODE": "4,4",
                      "SLURM_STEP_NUM_TASKS": "8"})
    monkeypatch.setattr(torch.cuda, "device_count", lambda: visible)
    assert env_mod.cuda_device_index(env) == expected
    # init_process_group pins that device (not cuda:<local rank>, which does not exist when narrowed)
    chosen = []

    class Stop(Exception):
        pass

    def set_device(index):
        chosen.append(index)
        raise Stop

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(Stop):
        init_process_group(env, backend="nccl", timeout_s=5)
    assert chosen == [expected]


def test_cuda_device_index_refuses_too_few_gpus_for_the_node(monkeypatch):
    import torch

    from pretrain.distributed import env as env_mod

    env = DistEnv(rank=5, world_size=8, local_rank=3, local_world_size=4, node_rank=1,
                  master_addr="gpu01", master_port=29512, launcher="torchrun")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)  # 4 ranks on this node, 2 GPUs, 3 >= 2
    with pytest.raises(ValueError, match="CUDA_VISIBLE_DEVICES"):
        env_mod.cuda_device_index(env)


def test_the_engine_hands_deepspeed_the_pinned_device_not_local_rank(monkeypatch):
    """DeepSpeed sets its device from LOCAL_RANK unless told otherwise: with CUDA_VISIBLE_DEVICES narrowed to one
    GPU per task (srun --gpus-per-task=1) that is cuda:3 for local rank 3, which does not exist."""
    import types

    import torch

    from pretrain.config import DistributedConfig, OptimConfig, TrainConfig
    from pretrain.distributed import engine as engine_mod

    seen = {}

    class Stop(Exception):
        pass

    def initialize(**kw):
        seen.update(kw)
        raise Stop

    monkeypatch.setattr(engine_mod, "_import_deepspeed", lambda: types.SimpleNamespace(initialize=initialize))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    env = detect_env({**SLURM_STEP, "SLURM_LOCALID": "1"})
    module = torch.nn.Linear(2, 2)
    optim = OptimConfig()
    with pytest.raises(Stop):
        engine_mod.Engine(module, [{"params": list(module.parameters())}], optim=optim,
                          train=TrainConfig(micro_batch_size=1, precision="fp32"), dist=DistributedConfig(),
                          env=env, lr_lambda=lambda step: 1.0)
    assert getattr(seen.get("args"), "device_rank", 1) == 0
