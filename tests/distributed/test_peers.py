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

rank, port, ready, world, frozen, leaving = (int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4]),
                                              int(sys.argv[5]), int(sys.argv[6]))
env = DistEnv(rank=rank, world_size=world, local_rank=0, local_world_size=1, node_rank=rank,
              master_addr="127.0.0.1", master_port=port, launcher="torchrun")
store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=600))
watch = PeerWatch(env, timeout_s=3, last_checkpoint=lambda: "The last good checkpoint is /runs/x/step_7").start()
open(ready + str(rank), "w").close()
if rank == leaving:
    time.sleep(1.0)
    watch.stop()  # this node finished cleanly (node 0 still hosts the store)
    time.sleep(600)
if rank == frozen:
    time.sleep(600)  # frozen by the test with SIGSTOP
dist.barrier()  # never completes: a node is frozen; only the watcher can end this process
print("barrier returned", flush=True)
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _nodes_until_one_freezes(tmp_path, world: int, frozen: int, leaving: int = -1, *, watcher: int,
                             settle_s: float = 1.5):
    """One process per "node" (RANK_SCRIPT); once all watch and ``settle_s`` has passed, node ``frozen`` is sent
    SIGSTOP. Returns (node ``watcher``'s returncode, its stdout, its stderr, seconds from the freeze to its end)."""
    port, ready = _free_port(), str(tmp_path / "ready")
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(r), str(port), ready, str(world), str(frozen),
                               str(leaving)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for r in range(world)]
    try:
        deadline = time.monotonic() + 120
        while not all(os.path.exists(ready + str(r)) for r in range(world)):
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs), \
                [p.communicate() for p in procs if p.poll() is not None]
            time.sleep(0.1)
        time.sleep(settle_s)  # every node heartbeats (and the leaving one has left)
        procs[frozen].send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        out, err = procs[watcher].communicate(timeout=60)
        took = time.monotonic() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.send_signal(signal.SIGCONT)
                p.kill()
            p.communicate()
    return procs[watcher].returncode, out, err, took


def test_a_silent_node_ends_the_other_within_the_peer_timeout(tmp_path):
    code, out, err, took = _nodes_until_one_freezes(tmp_path, 2, frozen=1, watcher=0)
    assert code == 69, (out, err)
    assert "barrier returned" not in out
    assert "lost node" in err and "node rank 1, ranks 1" in err and "/runs/x/step_7" in err, err
    assert "--exclude=" in err
    assert 2.5 < took < 15, took  # peer_timeout_s 3 (+ one heartbeat interval), far below distributed.timeout_s


def test_the_lowest_node_still_running_names_the_lost_one_when_node_0_has_left(tmp_path):
    """The report came from the lowest node among all but the lost ones, counting nodes that had left cleanly:
    with node 0 finished, no survivor reported, and node 1 ended 69 naming nothing."""
    code, out, err, _ = _nodes_until_one_freezes(tmp_path, 3, frozen=2, leaving=0, watcher=1, settle_s=2.5)
    assert code == 69, (out, err)
    assert "lost node" in err and "node rank 2, ranks 2" in err and "--exclude=" in err, err
