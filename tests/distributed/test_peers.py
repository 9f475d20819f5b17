"""The lost-node heartbeat on two local "nodes" (one gloo rank each): a node that goes silent without closing a
socket (SIGSTOP: no FIN, no RST) ends the other within distributed.peer_timeout_s, exit 69, naming it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

RANK_SCRIPT = r"""
import datetime, os, sys, time
import torch.distributed as dist
from pretrain.distributed.env import DistEnv
from pretrain.distributed.peers import PeerWatch

rank, port, ready = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
env = DistEnv(rank=rank, world_size=2, local_rank=0, local_world_size=1, node_rank=rank,
              master_addr="127.0.0.1", master_port=port, launcher="torchrun")
store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=600))
watch = PeerWatch(env, timeout_s=3, last_checkpoint=lambda: "The last good checkpoint is /runs/x/step_7").start()
open(ready + str(rank), "w").close()
if rank == 1:
    time.sleep(600)  # frozen by the test with SIGSTOP
dist.barrier()  # never completes: node 1 is frozen; only the watcher can end this process
print("barrier returned", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_silent_node_ends_the_other_within_the_peer_timeout(tmp_path):
    port, ready = _free_port(), str(tmp_path / "ready")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), str(port), ready], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1)]
    try:
        deadline = time.monotonic() + 120
        while not all(os.path.exists(ready + str(r)) for r in (0, 1)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.communicate() for p in procs if p.poll() is not None]
            time.sleep(0.1)
        time.sleep(1.5)  # both heartbeat
        procs[1].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        out, err = procs[0].communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.communicate()
    assert procs[0].returncode == 69, (out, err)
    assert "barrier returned" not in out
    assert "lost node" in err and "node rank 1, ranks 1" in err and "/runs/x/step_7" in err, err
    assert "--exclude=" in err
    assert 2.5 < took < 15, took  # peer_timeout_s 3 (+ one heartbeat interval), far below distributed.timeout_s


THREE_NODES = r"""
import datetime, os, sys, time
import torch.distributed as dist
from pretrain.distributed.env import DistEnv
from pretrain.distributed.peers import PeerWatch

rank, port, ready = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
env = DistEnv(rank=rank, world_size=3, local_rank=0, local_world_size=1, node_rank=rank,
              master_addr="127.0.0.1", master_port=port, launcher="torchrun")
store = dist.TCPStore("127.0.0.1", port, 3, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=3, timeout=datetime.timedelta(seconds=600))
watch = PeerWatch(env, timeout_s=3, last_checkpoint=lambda: "The last good checkpoint is /runs/x/step_7").start()
open(ready + str(rank), "w").close()
if rank == 0:
    time.sleep(1.0)
    watch.stop()  # node 0 finished cleanly (it still hosts the store)
    time.sleep(600)
if rank == 2:
    time.sleep(600)  # frozen by the test with SIGSTOP
dist.barrier()  # never completes
"""


def test_the_lowest_node_still_running_names_the_lost_one_when_node_0_has_left(tmp_path):
    """The report came from the lowest node among all but the lost ones, counting nodes that had left cleanly:
    with node 0 finished, no survivor reported, and node 1 ended 69 naming nothing."""
    port, ready = _free_port(), str(tmp_path / "ready")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", THREE_NODES, str(r), str(port), ready], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in (0, 1, 2)]
    try:
        deadline = time.monotonic() + 120
        while not all(os.path.exists(ready + str(r)) for r in (0, 1, 2)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.communicate() for p in procs if p.poll() is not None]
            time.sleep(0.1)
        time.sleep(2.5)  # node 0 has left, every node has seen it
        procs[2].send_signal(signal.SIGSTOP)
        out, err = procs[1].communicate(timeout=60)
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.communicate()
    assert procs[1].returncode == 69, (out, err)
    assert "lost node" in err and "node rank 2, ranks 2" in err and "--exclude=" in err, err
