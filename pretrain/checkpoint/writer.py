"""Checkpoints that do not stall training: snapshot in memory, write and publish in the background.

A save has two halves. ``snapshot_job`` is the collective, on the training path: DeepSpeed's state dicts of every
rank are copied into host buffers reused from save to save (``Engine.snapshot`` with the writer's ``StoragePool``,
distributed/snapshot.py; serialized at once where a copy cannot reproduce ``torch.save``'s bytes, and always for a
save that is waited for), with the rank's RNG state, and a background thread is handed them. Training goes on.
Each rank's thread then serializes and writes its own files (the exact bytes ``torch.save`` would write), fsyncs
them, hashes them as written and leaves a marker ``.done-rank<r>.json`` holding their digests. Rank 0's thread
also writes config.yaml and the tokenizer copy, waits for every rank's marker, consolidates ``model.safetensors``
from the files (read back on rank 0 while nobody waits for it), writes files.json and trainer_state.json and
publishes the tag by one rename (``store.publish``). A rank whose write
fails leaves ``.failed-rank<r>`` instead, and rank 0 removes the temporary tag: a checkpoint is complete or absent.
Every other rank also leaves ``.process-rank<r>.json`` (its machine's boot, pid namespace, pid and start time) when
the snapshot is taken: a rank on rank 0's machine killed before its marker (the OOM killer, a SIGKILL) is then given
up within a second, not at ``distributed.timeout_s`` (torchrun SIGKILLed the waiting rank 0 30 s after tearing the
job down, before it could remove the partial tag or release the run's lock). Another machine's rank is not judged.

``wait`` (collective) joins this rank's thread and agrees across ranks whether the save succeeded; a new save waits
for the previous one first, and so do the end of a run, a stop signal and a rollback. No collective runs in the
threads: the ranks agree only through the markers and in ``wait``. A second Ctrl-C ``abandon``s the save in flight:
its thread stops before its next file and the partial tag is removed (unless it was already published).

The main thread waits for a writer on an Event the thread sets as it ends, never in ``Thread.join``: on Python
3.11-3.12 a KeyboardInterrupt that lands inside ``join`` releases the running thread's state lock and marks it
stopped (bpo-45274's handler), so every later ``join`` returned at once and the process ended with the write half done.

Shapes: none (bytes and files).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pretrain.checkpoint import store
from pretrain.checkpoint.files import atomic_write_text, fsync_files
from pretrain.distributed.comm import all_reduce_host
from pretrain.distributed.engine import Pieces
from pretrain.distributed.snapshot import CopiedState, StoragePool
from pretrain.model.flat import layout_of

MARKER_POLL_S = 0.02
"""How often rank 0's writer looks for the other ranks' markers."""
PROCESS_CHECK_S = 0.5
"""How often rank 0's writer, waiting for a rank's marker, asks whether that rank's process still runs."""
CLOSE_GRACE_S = 60.0
"""A process that ends with a save in flight (an exception: other ranks may be gone) lets rank 0 wait this much longer
for the other ranks' markers, not the whole distributed.timeout_s."""


@dataclass(kw_only=True)
class SaveJob:
    """One rank's half of one save: what its writer thread writes, and on rank 0 what it publishes."""

    ckpt_dir: Path
    step: int
    rank: int
    world_size: int
    blobs: list[tuple[str, list[bytes] | CopiedState]]
    """(absolute path, its bytes in pieces or the state copied for ``torch.save``) of the files this rank writes."""
    # rank 0 only
    trainer_state: dict = field(default_factory=dict)
    config_yaml: str = ""
    flat_layout: dict = field(default_factory=dict)
    """model/flat.py's layout_of the module ({} for per-tensor parameters): flat_layout.json."""
    tokenizer_path: str | None = None
    keep_last: int = 1
    keep_every: int = 0
    timeout_s: float = 600.0
    """How long rank 0 waits for the other ranks' markers (distributed.timeout_s)."""
    deadline: float | None = None
    """time.monotonic() past which rank 0 stops waiting for markers; set when the job starts, shortened by close."""
    cancel: threading.Event = field(default_factory=threading.Event)
    """Set by ``CheckpointWriter.abandon``: the writer stops before its next file (``SaveAbandoned``)."""

    def check(self) -> None:
        """Raises SaveAbandoned once the save was abandoned."""
        if self.cancel.is_set():
            raise SaveAbandoned(f"the save of {self.tag} was abandoned (a second Ctrl-C)")

    @property
    def tag(self) -> str:
        return store.tag_for_step(self.step)

    @property
    def tmp_dir(self) -> Path:
        return self.ckpt_dir / (".tmp-" + self.tag)


class SaveAbandoned(Exception):
    """A save stopped by ``CheckpointWriter.abandon`` (its partial files are removed like a failed one's)."""


def snapshot_job(engine, env, run_dir, *, step: int, trainer_state: dict, config_yaml: str,
                 tokenizer_path: str | None, keep_last: int, timeout_s: float, keep_every: int = 0,
                 pool=None) -> SaveJob:
    """Collective: this rank's state in host memory for checkpoint ``step``: the bytes of the files it writes, or
    with a ``StoragePool`` (a background save) the states copied into its buffers, serialized by the writer.
    Rank 0 first clears leftovers of unfinished saves (no writer runs: the caller waited for the previous one)."""
    ckpt_dir = store.checkpoints_dir(run_dir)
    tmp_dir = ckpt_dir / (".tmp-" + store.tag_for_step(step))
    if env.is_main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        for stale in ckpt_dir.glob(".tmp-step_*"):
            shutil.rmtree(stale, ignore_errors=True)
    _barrier(env)
    blobs = engine.snapshot(str(ckpt_dir), tmp_dir.name, client_state={"step": step}, pool=pool)
    if env.is_distributed and not env.is_main:  # DeepSpeed's save made tmp_dir
        record = process_record()
        if record is not None:  # no fsync, no rename, in the pause: a record read half-written is read as none
            (tmp_dir / f".process-rank{env.rank}.json").write_text(json.dumps(record), encoding="utf-8")
    rng = {"torch": torch.get_rng_state(),
           "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}
    blobs.append((str(tmp_dir / f"rng_rank{env.rank}.pt"), _serialized(rng)))
    return SaveJob(ckpt_dir=ckpt_dir, step=step, rank=env.rank, world_size=env.world_size if env.is_distributed else 1,
                   blobs=blobs, trainer_state=json.loads(json.dumps(trainer_state)),  # a copy: training goes on
                   config_yaml=config_yaml, flat_layout=layout_of(engine.module), tokenizer_path=tokenizer_path,
                   keep_last=keep_last, keep_every=keep_every, timeout_s=timeout_s)


def _serialized(obj) -> list[bytes]:
    pieces = Pieces()
    torch.save(obj, pieces)
    return pieces.parts


def write_share(job: SaveJob) -> dict:
    """This rank's files written and fsynced; returns their digests by name relative to the tag (the whole sha256
    from memory, of the bytes as they are written; the sampled one read back: at most 8 MiB a file)."""
    whole = {}
    for path, held in job.blobs:
        job.check()
        with open(path, "wb") as f:
            out = _Hashing(f)
            if isinstance(held, CopiedState):
                held.save(out)
                held.release()  # its buffers go back to the pool for the next save
            else:
                for piece in held:
                    out.write(piece)
        whole[path] = out.sha.hexdigest()
    job.blobs = [(path, []) for path, _ in job.blobs]  # the snapshot's memory goes now
    fsync_files(whole)
    return {str(Path(path).relative_to(job.tmp_dir)): dict(store.file_digests(Path(path), full=False), sha256=sha)
            for path, sha in whole.items()}


class _Hashing:
    """A file that hashes what is written to it (``torch.save`` writes here piece by piece)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        return self.f.write(data)

    def flush(self) -> None:
        self.f.flush()


def run_rank(job: SaveJob) -> None:
    """A non-zero rank's writer: its files, then its marker (``.failed-rank<r>`` when writing failed)."""
    try:
        digests = write_share(job)
        atomic_write_text(job.tmp_dir / f".done-rank{job.rank}.json", json.dumps(digests))
    except BaseException as e:
        try:
            (job.tmp_dir / f".failed-rank{job.rank}").write_text(store.describe_error(e), encoding="utf-8")
        except OSError:
            pass
        raise


def run_main(job: SaveJob, *, on_published=None) -> Path:
    """Rank 0's writer: its files and the shared ones, every rank's digests, model.safetensors, files.json,
    trainer_state.json, then the publish. On any failure the temporary tag is removed."""
    try:
        digests = write_share(job)
        job.check()
        (job.tmp_dir / "config.yaml").write_text(job.config_yaml, encoding="utf-8")
        if job.flat_layout:
            atomic_write_text(job.tmp_dir / store.FLAT_LAYOUT_FILE, json.dumps(job.flat_layout))
        if job.tokenizer_path:
            shutil.copyfile(job.tokenizer_path, job.tmp_dir / "tokenizer.json")
        for rank in range(1, job.world_size):
            digests.update(_await_marker(job, rank))
        job.check()
        store.write_weights(job.tmp_dir, job.step, in_thread=True)
        job.check()
        store.record_files(job.tmp_dir, digests)
        state = dict(job.trainer_state, format_version=store.FORMAT_VERSION, step=job.step, tag=job.tag)
        state[store.FILES_RECORDED] = True  # a copy of the tag that lost files.json is then told from an old tag
        atomic_write_text(job.tmp_dir / store.STATE_FILE, json.dumps(state, indent=2))
        job.check()
        store.publish(job.ckpt_dir, job.tmp_dir, job.tag, job.keep_last, job.keep_every)
    except BaseException:
        shutil.rmtree(job.tmp_dir, ignore_errors=True)
        raise
    path = job.ckpt_dir / job.tag
    if on_published is not None:
        on_published(path)
    return path


def _await_marker(job: SaveJob, rank: int) -> dict:
    """Rank ``rank``'s digests, once its writer finished (the marker is removed: it is not part of the tag)."""
    done, failed = job.tmp_dir / f".done-rank{rank}.json", job.tmp_dir / f".failed-rank{rank}"
    process = job.tmp_dir / f".process-rank{rank}.json"
    next_check = time.monotonic() + PROCESS_CHECK_S
    while not done.is_file():
        job.check()
        if failed.is_file():
            why = failed.read_text(encoding="utf-8", errors="replace").strip() or "its error is in its log"
            raise store.CheckpointError(f"rank {rank} could not write its files ({why})")
        now = time.monotonic()
        if now > job.deadline:
            raise store.CheckpointError(f"rank {rank} did not finish writing its files in time "
                                        f"(distributed.timeout_s={job.timeout_s:g} s)")
        if now >= next_check:
            next_check = now + PROCESS_CHECK_S
            pid = process_ended(process)
            if pid is not None and not done.is_file():  # the marker may have come just before a normal exit
                raise store.CheckpointError(f"rank {rank}'s process (pid {pid}) ended before it finished writing "
                                            f"its files (killed?)")
        time.sleep(MARKER_POLL_S)
    digests = json.loads(done.read_text(encoding="utf-8"))
    done.unlink()
    process.unlink(missing_ok=True)
    return digests


def process_record(pid: int | None = None) -> dict | None:
    """What tells process ``pid`` (this one by default) on this machine from any other, now and later: the kernel's
    boot id, the pid namespace, the pid and its start time; None where /proc does not say (not Linux)."""
    pid = os.getpid() if pid is None else pid
    try:
        boot = _boot_id()
        namespace = os.stat(f"/proc/{pid}/ns/pid").st_ino
    except OSError:
        return None
    stat = _proc_stat(pid)
    return None if stat is None else {"boot": boot, "pid_ns": namespace, "pid": pid, "start": stat[1]}


@functools.cache
def _boot_id() -> str:
    return Path("/proc/sys/kernel/random/boot_id").read_text(encoding="ascii").strip()


@functools.cache
def _here() -> tuple[str, int] | None:
    """(boot id, pid namespace) of this process, read once; None where /proc does not say."""
    try:
        return _boot_id(), os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return None


def process_ended(path: Path) -> int | None:
    """The pid recorded in ``path`` (``process_record``) when that process has ended: no such process, a zombie, or
    another process under its pid since. None while it runs, and when it cannot be told from here (no record or an
    unreadable one, another machine or pid namespace): the record is another rank's, read as untrusted."""
    try:
        record = json.loads(path.read_text(encoding="utf-8"))
        pid, start = int(record["pid"]), int(record["start"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if pid <= 0 or _here() is None or (record.get("boot"), record.get("pid_ns")) != _here():
        return None
    stat = _proc_stat(pid)
    return pid if stat is None or stat[0] in "ZXx" or stat[1] != start else None


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks since boot) of process ``pid``, or None when there is none."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text(encoding="ascii", errors="replace")
    except OSError:
        return None
    fields = raw[raw.rfind(")") + 2:].split()  # after "pid (comm) ": the command may hold spaces and parentheses
    try:
        return fields[0], int(fields[19])
    except (IndexError, ValueError):
        return None


class CheckpointWriter:
    """This rank's background writer: at most one save in flight; ``wait`` is the collective that ends it."""

    def __init__(self, env, *, on_published=None):
        self.env = env
        self.on_published = on_published  # rank 0, in the writer thread, after the publish: fn(tag_dir)
        self._thread: threading.Thread | None = None
        self._done = threading.Event()
        """Set by the writer thread as it ends (what the main thread waits on: module docstring)."""
        self._job: SaveJob | None = None
        self._error: BaseException | None = None
        self._published: Path | None = None
        self.pool = StoragePool()
        """Host buffers of the last background snapshot, reused by the next (distributed/snapshot.py)."""

    @property
    def in_flight(self) -> int | None:
        """The step of the save not yet waited for, or None."""
        return self._job.step if self._job is not None else None

    def start(self, job: SaveJob) -> Path:
        """Hand ``job`` to a new thread (the previous save must have been waited for); returns the tag dir it
        publishes."""
        assert self._thread is None, "a save is still in flight: wait() first"
        self._job, self._error, self._published = job, None, None
        job.deadline = time.monotonic() + job.timeout_s
        self._done.clear()
        # Not a daemon: an interpreter that exits (normal end, an exception) finishes the write first.
        thread = threading.Thread(target=self._run, args=(job,), name=f"checkpoint-writer-{job.tag}", daemon=False)
        thread.start()
        self._thread = thread  # only once started: join() waits on _done only for a thread that will set it
        return job.ckpt_dir / job.tag

    def _run(self, job: SaveJob) -> None:
        try:
            if job.rank == 0:
                self._published = run_main(job, on_published=self.on_published)
            else:
                run_rank(job)
        except BaseException as e:  # noqa: BLE001 - reported by wait() (collectively), or by close()
            self._error = e
        finally:
            self._done.set()

    def join(self) -> BaseException | None:
        """This rank's thread finished (not collective); its error, if any. Waits on ``_done``, not in
        ``Thread.join`` (module docstring); a KeyboardInterrupt here leaves the save in flight, as it was."""
        if self._thread is not None:
            self._done.wait()
            self._thread = None  # it has nothing left to run but its own end
        return self._error

    def wait(self) -> Path | None:
        """Collective: the save in flight finished on every rank; returns its published tag dir (None when no save
        was in flight) or raises CheckpointError on every rank when any rank's part failed."""
        job = self._job
        if job is None:
            return None
        error = self.join()
        self._job, self._error = None, None
        try:
            failed = _any_rank(self.env, error is not None)
        except Exception as e:  # a rank is gone (its sockets closed): say what failed here, if anything did
            if error is None:
                raise
            raise store.CheckpointError(f"saving checkpoint {job.tag} failed ({store.describe_error(error)}); the "
                                        f"ranks could not agree on it") from e  # e says why (a rank is gone)
        if failed:
            if self.env.is_main:  # every rank's writer has stopped by now: what one wrote after rank 0's own
                shutil.rmtree(job.tmp_dir, ignore_errors=True)  # removal (a race the chaos soak hit) goes too
            previous = store.find_intact(job.ckpt_dir)[0]  # the newest that verifies: a resume's
            why = store.describe_error(error) if error is not None else "on another rank"
            raise store.CheckpointError(
                f"saving checkpoint {job.tag} failed ({why}); the partial files were removed and the previous "
                f"checkpoint ({previous or 'none'}) is intact. Free disk space in {job.ckpt_dir} and resume.")
        return job.ckpt_dir / job.tag

    def close(self) -> BaseException | None:
        """Not collective (other ranks may be gone): finish this rank's write in flight; its error, if any."""
        if self._job is not None and self._job.deadline is not None:
            self._job.deadline = min(self._job.deadline, time.monotonic() + CLOSE_GRACE_S)
        error = self.join()
        self._job, self._error = None, None
        return error

    def cancel(self) -> None:
        """The save in flight (if any) stops before its next file; a signal handler may call it (no wait)."""
        if self._job is not None:
            self._job.cancel.set()

    def abandon(self) -> Path | None:
        """Not collective (a second Ctrl-C on this rank): the save in flight stops before its next file and its
        partial files are removed (rank 0's writer removes the temporary tag; another rank's leaves its
        ``.failed-rank`` marker, which stops rank 0's). Returns the tag dir when rank 0's writer had published it
        already, else None (nothing in flight, another rank, or abandoned)."""
        job = self._job
        if job is None:
            return None
        self.cancel()
        self.join()
        published, self._job, self._error = self._published, None, None
        return published


def _barrier(env) -> None:
    if env.is_distributed:
        torch.distributed.barrier()


def _any_rank(env, flag: bool) -> bool:
    if not env.is_distributed:
        return flag
    return bool(all_reduce_host(torch.tensor([1 if flag else 0], dtype=torch.int64)).item())
