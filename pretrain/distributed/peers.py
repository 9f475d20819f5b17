"""A lost node ends a multi-node job in seconds, with a message naming it and what to resume from.

A worker that crashes closes its sockets: its peers' next collective fails at once and the launchers tear the
job down. A node that loses power or its network closes nothing, and every other rank would block in its
collective for ``distributed.timeout_s`` (10 min by default), then fail naming no node. So every rank of a
multi-node job adds to its node's counter in the job's rendezvous store every ``interval_s`` and reads all
counters back: a node whose counter has not moved for ``timeout_s`` is lost, and every surviving rank exits with
NODE_LOST_EXIT_CODE (the lowest surviving node's local rank 0 first says which node it was and what to resume
from). Counters, not clocks: nodes need not agree on the time, and a rank that was merely paused sees its peers'
counters moved, not stale. A rank that finishes cleanly adds LEFT to its node's counter, and that node is no
longer watched. If the store itself (hosted on the head node) stops answering for ``timeout_s``, the head node is
taken as lost. Exercised end to end by tests/integration/test_slurm_multinode.py (a node cut off mid-run).
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket
import sys
import threading
import time
from collections.abc import Callable

from pretrain.distributed.env import DistEnv

NODE_LOST_EXIT_CODE = 69
"""Exit status of a rank that gave up on a lost node (EX_UNAVAILABLE); torchrun reports it as 1."""
LEFT = 1 << 40
"""Added to a node's counter when one of its ranks stops cleanly: the node is no longer watched."""


class PeerWatch:
    """The heartbeat thread of one rank; `stop()` on a clean exit. A no-op on a single node."""

    def __init__(self, env: DistEnv, *, timeout_s: float, last_checkpoint: Callable[[], str] = lambda: "",
                 on_lost: Callable[[], None] = lambda: None, interval_s: float | None = None) -> None:
        self.env, self.timeout_s = env, float(timeout_s)
        self.interval_s = interval_s or min(max(self.timeout_s / 10, 0.5), 5.0)
        self.last_checkpoint, self.on_lost = last_checkpoint, on_lost
        """What the message names to resume from (e.g. "the last good checkpoint is …"); what to do before exiting
        (release the run directory's lock)."""
        self.nodes: dict[int, tuple[str, list[int]]] = {}
        """node rank -> (host name, its global ranks), registered by every rank at start."""
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._store = None
        self._prefix = ""

    @property
    def enabled(self) -> bool:
        return self.timeout_s > 0 and self.env.world_size > self.env.local_world_size

    def start(self) -> PeerWatch:
        """Collective (every rank calls it): register this rank's node and host, wait for all, start watching."""
        if not self.enabled:
            return self
        import torch.distributed as dist

        box = [secrets.token_hex(4) if self.env.is_main else None]  # keys of this incarnation only
        dist.broadcast_object_list(box, src=0)
        self._prefix = f"pretrain/peers/{box[0]}/"
        self._connect()
        self._store.set(f"{self._prefix}rank/{self.env.rank}", f"{self.env.node_rank} {socket.gethostname()}")
        self._store.add(self._key(self.env.node_rank), 1)
        keys = [f"{self._prefix}rank/{r}" for r in range(self.env.world_size)]
        self._store.wait(keys, datetime.timedelta(seconds=max(10 * self.timeout_s, 60)))
        for rank, raw in enumerate(self._store.multi_get(keys)):
            node, host = raw.decode().split(" ", 1)
            self.nodes.setdefault(int(node), (host, []))[1].append(rank)
        self._thread = threading.Thread(target=self._watch, name="pretrain-peer-watch", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """This rank finished cleanly: stop watching, and tell the others not to wait for this node."""
        if self._thread is None or self._stopped.is_set():
            return
        self._stopped.set()
        self._thread.join(timeout=2 * self._op_timeout_s)
        try:
            self._timed(lambda store: store.add(self._key(self.env.node_rank), LEFT))
        except Exception:  # the store went away with the head node: nobody is left to tell
            pass

    # -- the thread ----------------------------------------------------------------------------------
    def _key(self, node: int) -> str:
        return f"{self._prefix}node/{node}"

    @property
    def _op_timeout_s(self) -> float:
        return max(self.timeout_s / 3, 1.0)

    def _connect(self):
        import torch.distributed as dist

        # A client of its own: its blocking calls never hold up the process group's use of the store.
        self._store = dist.TCPStore(self.env.master_addr, self.env.master_port, is_master=False,
                                    timeout=datetime.timedelta(seconds=self._op_timeout_s))
        return self._store

    def _timed(self, op: Callable):
        """op(store) in a helper thread, given up after _op_timeout_s: a TCPStore client waits for a reply without
        any timeout, for as long as TCP keeps retrying (~15 min) when the head node vanished without a FIN. A
        client that timed out is dropped (the next call connects anew), so a late reply is never misread."""
        out: dict = {}

        def call() -> None:
            try:
                out["value"] = op(self._store if self._store is not None else self._connect())
            except Exception as e:
                out["error"] = e

        helper = threading.Thread(target=call, name="pretrain-peer-store", daemon=True)
        helper.start()
        helper.join(self._op_timeout_s)
        if helper.is_alive() or "error" in out:
            self._store = None
            raise out.get("error") or TimeoutError(f"no reply from the store in {self._op_timeout_s:.0f} s")
        return out["value"]

    def _beat(self, store, watched: list[int]) -> list[int]:
        """Tick this node's counter; read the watched nodes' counters."""
        store.add(self._key(self.env.node_rank), 1)
        return [int(v) for v in store.multi_get([self._key(n) for n in watched])]

    def _watch(self) -> None:
        now = time.monotonic()
        last_ok, seen = now, {node: (-1, now) for node in self.nodes}
        watched = sorted(self.nodes)
        while not self._stopped.wait(self.interval_s):
            try:
                counts = self._timed(lambda store: self._beat(store, watched))
            except Exception as e:
                if self._stopped.is_set():
                    return
                if time.monotonic() - last_ok > self.timeout_s:
                    self._give_up(self._head_lost_message(time.monotonic() - last_ok, e),
                                  report=self.env.local_rank == 0)
                continue
            now = last_ok = time.monotonic()
            for node, count in zip(watched, counts):
                if count != seen[node][0]:
                    seen[node] = (count, now)
            watched = [n for n, c in zip(watched, counts) if c < LEFT]
            lost = {n: now - seen[n][1] for n in watched if now - seen[n][1] > self.timeout_s}
            if lost:  # the lowest node still running reports (not one that left cleanly: it says nothing)
                alive = [n for n in watched if n not in lost]
                report = self.env.local_rank == 0 and alive[:1] == [self.env.node_rank]
                self._give_up(self._lost_message(lost) if report else "", report=report)

    def _give_up(self, message: str, *, report: bool) -> None:
        if self._stopped.is_set():
            return
        if report:
            print(message, file=sys.stderr, flush=True)
            try:
                self._timed(lambda store: store.set(f"{self._prefix}reported", "1"))
            except Exception:
                pass
        else:
            # The reporting rank may notice the loss up to a heartbeat later; were this rank to exit first, the
            # reporter's own collective would fail on the closed connection with a traceback before it could say
            # which node was lost. Wait until it has reported (bounded).
            deadline = time.monotonic() + 2 * self.interval_s + 2
            while time.monotonic() < deadline:
                try:
                    if self._timed(lambda store: store.check([f"{self._prefix}reported"])):
                        break
                except Exception:
                    pass
                time.sleep(0.2)
        try:
            self.on_lost()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(NODE_LOST_EXIT_CODE)  # the main thread is blocked in a collective that will never finish

    # -- messages -------------------------------------------------------------------------------------
    def _lost_message(self, lost: dict[int, float]) -> str:
        names = "; ".join(f"node {self.nodes[n][0]} (node rank {n}, ranks {_span(self.nodes[n][1])}) has sent no "
                          f"heartbeat for {age:.0f} s" for n, age in sorted(lost.items()))
        hosts = ",".join(self.nodes[n][0] for n in sorted(lost))
        return (f"pretrain: lost {names}: it crashed or was cut off the network. Ending the job now instead of "
                f"waiting in a collective until distributed.timeout_s. {self._resume_from()}; resubmit the job "
                f"without that node (e.g. sbatch --exclude={hosts}) to resume from it.")

    def _head_lost_message(self, age: float, error: Exception) -> str:
        head = self.nodes.get(0, (self.env.master_addr, []))[0]
        why = (str(error).strip().splitlines() or [""])[0]
        return (f"pretrain: lost the head node {head} (node rank 0): the job's store at {self.env.master_addr}:"
                f"{self.env.master_port} has not answered for {age:.0f} s ({type(error).__name__}: {why}). Ending "
                f"this rank now. {self._resume_from()}.")

    def _resume_from(self) -> str:
        try:
            return self.last_checkpoint() or "The last good checkpoint is unknown"
        except Exception as e:  # the message must go out whatever the run directory looks like
            return f"The last good checkpoint could not be determined ({e})"


def _span(ranks: list[int]) -> str:
    return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)) \
        else ",".join(map(str, ranks))


PEER_GONE_SIGNS = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
                   "remote process exited", "ncclRemoteError", "NCCL communicator was aborted")
"""What gloo's TCP transport and NCCL say when another rank of the collective is gone (its process ended, its sockets
closed): a crash, the OOM killer, a SIGKILL."""


def peer_gone(error: BaseException) -> str | None:
    """The line of ``error`` (or of an exception it was raised from) that says a collective failed because another
    rank is gone, without gloo's source path; None when nothing in it says so."""
    import torch.distributed as dist

    seen: set[int] = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        text = str(error)
        if isinstance(error, dist.DistNetworkError) or any(sign in text for sign in PEER_GONE_SIGNS):
            line = text.strip().splitlines()[0] if text.strip() else type(error).__name__
            line = line.split("] ", 1)[1] if line.startswith("[") and "] " in line else line
            return line.split(". ", 1)[0]  # gloo goes on: "This is typically caused by a remote worker ..."
        error = error.__cause__ or error.__context__
    return None
