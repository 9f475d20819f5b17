"""One trainer per run directory: ``<run_dir>/run.lock``, held by rank 0 for the whole run.

The lock is a small JSON file (host, pid, job, start time, a heartbeat counter, a random token) created with
``O_CREAT | O_EXCL`` and rewritten by a heartbeat thread, because ``flock`` is not honoured reliably on the
shared filesystems runs live on (NFS). Who may take it:

- the same job (its Slurm job id, with the array task where there is one): at once, from any host — a
  requeued job whose previous run was SIGKILLed (a checkpoint longer than KillWait) continues;
- anyone, from a holder on this very host whose pid is gone, or from an unreadable lock file: at once;
- anyone else, from a holder whose heartbeat does not change for ``stale_after_s`` *as this reader watches
  it* (its own monotonic clock: clocks of different hosts are never compared);
- otherwise the trainer stops with a message naming the holder.

Every takeover is an atomic rename followed by a re-read that confirms the token (of two trainers taking
over at once exactly one keeps the lock), and says so in a warning.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from pathlib import Path

import torch

from pretrain.distributed.comm import all_reduce_host
from pretrain.distributed.env import job_id, pid_alive
from pretrain.metrics.writer import print_progress

LOCK_NAME = "run.lock"
HEARTBEAT_S = 30.0
STALE_AFTER_S = 300.0
UNREADABLE_S = 2.0
"""How long an unreadable lock file is read again before it is taken over."""
UNREADABLE_BEATS = 3
"""Heartbeats in a row at which the holder's own lock file may be unreadable before the holder takes it as lost (and
stops without saving): one failed read on a soft NFS mount ended a run that nobody had taken over. A lock taken
over reads back with the other trainer's token, which ends the run at once."""


class RunDirLocked(ValueError):
    """Another live trainer holds the run directory."""


def _fmt_time(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


class RunLock:
    def __init__(self, run_dir: str | os.PathLike, *, heartbeat_s: float = HEARTBEAT_S,
                 stale_after_s: float = STALE_AFTER_S) -> None:
        self.path = Path(run_dir) / LOCK_NAME
        self.heartbeat_s, self.stale_after_s = heartbeat_s, stale_after_s
        self.token = secrets.token_hex(8)
        self.me = {"host": socket.gethostname(), "pid": os.getpid(), "job": job_id(), "since": time.time(),
                   "token": self.token}
        self.beats = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.lost = False
        """Set when the heartbeat finds the lock taken by someone else (the trainer then stops)."""

    # -- acquiring ----------------------------------------------------------------------------------
    def acquire(self) -> str | None:
        """Take the lock; returns a warning line when another's lock was taken over, raises RunDirLocked when a
        live trainer of another job holds it (after watching its heartbeat for up to ``stale_after_s``)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self._create():
            self._start_heartbeat()
            return None
        holder = self._read_settled()
        reason = "its lock file is unreadable" if holder is None else self._takeover_reason(holder)
        if reason is None:
            age = time.time() - float(holder.get("heartbeat", holder.get("since", 0)))
            if holder.get("host") == self.me["host"]:  # _takeover_reason looked at the pid itself
                alive = f"its pid runs on this host (lock file {self.path})"
                dead = "is taken over at once (this host sees its pid end)"
            else:
                alive = (f"its heartbeat changed while this trainer watched (last written {age:.0f}s ago by its "
                         f"clock; lock file {self.path})")
                dead = f"is taken over once its heartbeat has not changed for {self.stale_after_s:.0f}s"
            raise RunDirLocked(
                f"run directory {self.path.parent} is in use by another trainer: host {holder.get('host')}, "
                f"pid {holder.get('pid')}, job {holder.get('job') or 'unknown'}, running since "
                f"{_fmt_time(float(holder.get('since', 0)))}, {alive}. Wait for it to finish or stop it (scancel), "
                f"or use another run_dir; a holder that died {dead}, and a requeue of the same job takes over at "
                f"once.")
        self._replace()
        time.sleep(min(0.2, self.heartbeat_s))  # let a concurrent taker's rename land, then see who won
        now = self._read()
        if now is None or now.get("token") != self.token:
            raise RunDirLocked(f"run directory {self.path.parent}: another trainer took over its stale lock at the "
                               f"same moment ({now}); use another run_dir or retry")
        self._start_heartbeat()
        prev = (f"host {holder.get('host')}, pid {holder.get('pid')}, job {holder.get('job') or 'unknown'}"
                if holder else "unknown")
        return f"warning: took over the lock of run directory {self.path.parent} from {prev} ({reason})"

    def _takeover_reason(self, holder: dict) -> str | None:
        """Why ``holder``'s lock may be taken over now, or None when it is held by a live trainer."""
        if self.me["job"] and holder.get("job") == self.me["job"]:
            return f"the same job {self.me['job']}: a requeue or restart of it"
        if holder.get("host") == self.me["host"]:  # this host can look at the pid itself
            pid = int(holder.get("pid", -1))
            if pid == os.getpid():
                return "held by this same process: a trainer that was never closed"
            return None if pid_alive(pid) else f"pid {pid} is no longer running on this host"
        return self._watch(holder)

    def _watch(self, holder: dict) -> str | None:
        """Re-reads the lock until its heartbeat changes (live: None) or ``stale_after_s`` pass on this reader's
        own clock without a change (gone: the reason)."""
        seen = (holder.get("token"), holder.get("beats"), holder.get("heartbeat"))
        start = time.monotonic()
        while time.monotonic() - start < self.stale_after_s:
            time.sleep(min(self.heartbeat_s / 4, self.stale_after_s / 10, 5.0))
            now = self._read()
            if now is not None and (now.get("token"), now.get("beats"), now.get("heartbeat")) != seen:
                return None
        return f"its heartbeat did not change for {self.stale_after_s:.0f}s"

    def _read_settled(self) -> dict | None:
        """The lock's holder, read again for up to ``UNREADABLE_S`` while it is unreadable: a read that failed while
        the holder rewrote it on another host (NFS) is not a dead holder. None when it stays unreadable (a lock
        file left torn by a crash), which is then taken over."""
        deadline = time.monotonic() + min(UNREADABLE_S, self.stale_after_s)
        holder = self._read()
        while holder is None and time.monotonic() < deadline and self.path.exists():
            time.sleep(0.1)
            holder = self._read()
        return holder

    def _payload(self) -> bytes:
        return json.dumps(dict(self.me, heartbeat=time.time(), beats=self.beats)).encode()

    def _create(self) -> bool:
        """Publish the lock, complete, under its name unless a lock is there. A hard link of a written file, not
        ``O_CREAT | O_EXCL`` and a write: that file is empty until the write, and a trainer starting at the same
        moment read it as unreadable and took it over while its creator went on (both held it until the next
        heartbeat). ``link`` fails with EEXIST atomically, also on NFS; where the filesystem has no hard links, the
        exclusive create is what is left."""
        tmp = self.path.with_name(f".{LOCK_NAME}.{self.token}")
        try:
            self._write(os.open(tmp, os.O_CREAT | os.O_TRUNC | os.O_WRONLY, 0o644))
        except OSError as e:  # named as the lock file: what the user knows of (a read-only run_dir)
            raise OSError(e.errno, e.strerror, str(self.path)) from None
        try:
            os.link(tmp, self.path)
        except FileExistsError:
            return False
        except OSError:  # no hard links here (EPERM, ENOTSUP: some FUSE and SMB mounts)
            try:
                self._write(os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
            except FileExistsError:
                return False
        finally:
            tmp.unlink(missing_ok=True)
        return True

    def _write(self, fd: int) -> None:
        with os.fdopen(fd, "wb") as f:
            f.write(self._payload())
            f.flush()
            os.fsync(f.fileno())

    def _replace(self) -> None:
        tmp = self.path.with_name(f".{LOCK_NAME}.{self.token}")
        tmp.write_bytes(self._payload())
        os.replace(tmp, self.path)

    def _read(self) -> dict | None:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None
        return data if isinstance(data, dict) else None

    # -- holding ------------------------------------------------------------------------------------
    def _start_heartbeat(self) -> None:
        self._thread = threading.Thread(target=self._beat, name="run-lock-heartbeat", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        unreadable = 0
        while not self._stop.wait(self.heartbeat_s):
            holder = self._read()
            if holder is None and self.path.exists() and unreadable + 1 < UNREADABLE_BEATS:
                unreadable += 1  # a failed read (an NFS EIO, a torn view) is no takeover: one that is reads back
                continue
            if holder is None or holder.get("token") != self.token:
                self.lost = True
                return
            unreadable = 0
            self.beats += 1
            try:
                self._replace()
            except OSError:
                pass  # a transient filesystem error: the next beat retries

    def release(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        holder = self._read()
        if holder is not None and holder.get("token") == self.token:
            self.path.unlink(missing_ok=True)


def lock_run_dir(run_dir: Path, env) -> RunLock | None:
    """Rank 0 takes ``run_dir/run.lock`` and makes sure it can write the run's checkpoints; every rank stops
    (RunDirLocked) when it cannot: at the start, not at the first save after hours of training."""
    lock, error = None, ""
    if env.is_main:
        lock = RunLock(run_dir)
        try:
            warning = lock.acquire()
            _probe_writable(Path(run_dir) / "checkpoints")
        except RunDirLocked as e:
            lock, error = None, str(e)
        except OSError as e:  # a read-only mount, permissions, a file where a directory belongs
            lock.release()
            lock, error = None, (f"cannot write in {e.filename or run_dir} ({e.strerror or type(e).__name__}): the "
                                 f"trainer writes its lock, metrics and checkpoints in run_dir {run_dir}. Make it "
                                 f"writable, or set another run_dir")
        else:
            if warning:
                print_progress(warning)
    failed = bool(error)
    if env.is_distributed:
        failed = bool(all_reduce_host(torch.tensor([int(failed)])).item())
    if failed:
        raise RunDirLocked(error or f"rank 0 could not lock the run directory {run_dir} (see its message)")
    return lock


def _probe_writable(directory: Path) -> None:
    """OSError unless a file can be created in ``directory``, when it exists (else the lock was just written beside
    it); the probe file is removed."""
    if not directory.exists():
        return
    probe = directory / f".write-probe-{secrets.token_hex(4)}"
    try:
        os.close(os.open(probe, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
    except OSError as e:
        raise OSError(e.errno, e.strerror, str(directory)) from None
    probe.unlink()
