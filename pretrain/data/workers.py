"""A DataLoader worker's death as one line: the workers are taken out of torch's SIGCHLD check (which raises from
whatever the main process runs when one dies) and put back only while the loader waits for a batch
(``ResumableLoader._checked``); a worker killed by a signal or out of memory, or none delivering a batch within
``data.timeout_s``, becomes a ``DataWorkerError``. And the workers' end: every one a loader started is SIGKILLed at
the latest when the process exits (they ignore the SIGTERM of torch's and multiprocessing's shutdown)."""

from __future__ import annotations

import atexit
import os
import signal
import weakref

import torch


DATA_WORKER_EXIT_CODE = 5
"""pretrain-train's exit code when the data loader's workers failed (``DataWorkerError``): not the input error's 2,
since the same command may well succeed when relaunched (another node, more memory, the mount back)."""


class DataWorkerError(RuntimeError):
    """A DataLoader worker died (killed by a signal: the OOM killer's SIGKILL, a SIGBUS from a full /dev/shm or a
    shard truncated under its map), ran out of memory, or delivered no batch for ``data.timeout_s`` (stuck on a hung
    mount): one line naming the worker, the cause and what to do, which the entry point prints instead of a
    traceback (exit ``DATA_WORKER_EXIT_CODE``)."""


_signal_handling = torch.utils.data._utils.signal_handling


def defer_worker_checks(it) -> None:
    """Take ``it``'s workers out of torch's SIGCHLD check, which raises "worker is killed by signal" from whatever
    the main process runs when a worker dies (the model's forward, a checkpoint being written):
    ``ResumableLoader._checked`` puts them back only while it waits for a batch, and names a worker that died
    between two waits itself."""
    if getattr(it, "_worker_pids_set", False):
        _signal_handling._remove_worker_pids(id(it))
        it._worker_pids_set = False  # so that its shutdown does not remove them again (an error)


def watch_workers(it) -> bool:
    """Put the workers of ``it`` (taken out by ``defer_worker_checks``) back in torch's SIGCHLD check."""
    workers = getattr(it, "_workers", None)
    if not workers or getattr(it, "_worker_pids_set", True):
        return False
    _signal_handling._set_worker_pids(id(it), tuple(w.pid for w in workers))
    return True


def unwatch_workers(it) -> None:
    _signal_handling._remove_worker_pids(id(it))


def worker_failure(e: BaseException | None, it, position: int) -> DataWorkerError | None:
    """``DataWorkerError`` for an error the DataLoader raised because a worker died (or raised MemoryError) or
    timed out (``timeout``), or with ``e`` None for a worker of ``it`` that is dead; None for any other error
    (re-raised as it is)."""
    workers = getattr(it, "_workers", ())
    dead = [(i, w) for i, w in enumerate(workers) if w.exitcode not in (None, 0)]
    where = f"while building batches at data position {position} (samples consumed)"
    if isinstance(e, RuntimeError) and str(e).startswith("DataLoader timed out after") and not dead:
        return stalled(workers, getattr(it, "_timeout", 0), where)
    if isinstance(e, MemoryError) and str(e).startswith("Caught MemoryError in DataLoader worker"):
        return DataWorkerError(f"a data loader worker ran out of memory (MemoryError) {where}; lower "
                               "data.num_workers or data.prefetch_factor, or give the job more memory; resuming "
                               "continues from the last checkpoint")
    if not dead or (e is not None and not str(e).startswith("DataLoader worker (pid")):  # torch's words for it
        return None
    i, w = dead[0]
    code = w.exitcode
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        how = f"was killed by {name}"
        why = {signal.SIGKILL: ": most often the kernel's OOM killer (see dmesg or the job's memory report); lower "
                               "data.num_workers or data.prefetch_factor, or give the job more memory",
               signal.SIGBUS: ": shared memory ran out (/dev/shm: a container's 64 MB default is too small; "
                              "give the job a larger one) or a dataset file was truncated under its memory map "
                              "(check it with pretrain-preprocess --verify)"}.get(-code, "")
    else:
        how, why = f"exited with status {code}", ""
    return DataWorkerError(f"data loader worker {i} (pid {w.pid}) {how} {where}{why}; resuming continues from "
                           "the last checkpoint")


def stalled(workers, timeout_s: float, where: str) -> DataWorkerError:
    """The workers delivered nothing for ``timeout_s``: which of them the kernel holds in an uninterruptible wait
    (state D: a read from a hung NFS/Lustre mount or a dying disk) or which are alive at all."""
    states = []
    for i, w in enumerate(workers):
        try:
            with open(f"/proc/{w.pid}/stat", encoding="ascii", errors="replace") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            state = "?"
        states.append(f"worker {i} (pid {w.pid}) " + {"D": "in an uninterruptible I/O wait (state D)",
                                                      "R": "running", "S": "sleeping"}.get(state, f"state {state}"))
    return DataWorkerError(f"no batch from the data loader's workers for {timeout_s:g} s (data.timeout_s) {where}: "
                           f"{'; '.join(states)}. A worker is stuck: most often a read from a hung filesystem "
                           "mount (the dataset's directory) or a remote read that does not return; if batches "
                           "really take that long, raise data.timeout_s (0 waits forever). Resuming continues from "
                           "the last checkpoint")


_LIVE_LOADERS: "weakref.WeakSet" = weakref.WeakSet()
"""Every ResumableLoader (``data/loader.py``) with worker processes in this process, until it is collected."""
_LIVE_WORKERS: "weakref.WeakSet" = weakref.WeakSet()
"""Every DataLoader worker process a ResumableLoader started in this process. A loader dropped without ``close``
(an error unwinding the trainer, a validation iterator left half-read) has its workers asked to exit by torch's
iterator finaliser, which SIGTERMs the slow ones: ignored by our workers, so multiprocessing's exit handler would
then wait for them forever. The exit handler below closes the loaders still alive (torch's shutdown first: it
releases the index queues' feeder threads, which multiprocessing's finalisers would otherwise join forever once
their reader is dead), then SIGKILLs whatever worker is still alive."""


def kill_workers(workers) -> None:
    """SIGKILL each worker process still alive and reap it."""
    for w in list(workers):
        if w.is_alive():
            try:
                os.kill(w.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            w.join(timeout=5)


@atexit.register  # registered after multiprocessing's own handler, so it runs before it
def _stop_live_workers() -> None:
    for loader in list(_LIVE_LOADERS):
        loader.close()
    kill_workers(_LIVE_WORKERS)
