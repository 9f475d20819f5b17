"""A DataLoader worker's death as one line: the workers are taken out of torch's SIGCHLD check (which raises from
whatever the main process runs when one dies) and put back only while the loader waits for a batch
(``ResumableLoader._checked``); a worker killed by a signal or out of memory becomes a ``DataWorkerError``."""

from __future__ import annotations

import signal

import torch


class DataWorkerError(ValueError):
    """A DataLoader worker died (killed by a signal: the OOM killer's SIGKILL, a SIGBUS from a full /dev/shm or a
    shard truncated under its map) or ran out of memory: one line naming the worker, the cause and what to do. A
    ValueError, so the entry point prints it as the run's one-line error (exit 2) instead of a traceback."""


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
    """``DataWorkerError`` for an error the DataLoader raised because a worker died (or raised MemoryError), or
    with ``e`` None for a worker of ``it`` that is dead; None for any other error (re-raised as it is)."""
    workers = getattr(it, "_workers", ())
    dead = [(i, w) for i, w in enumerate(workers) if w.exitcode not in (None, 0)]
    where = f"while building batches at data position {position} (samples consumed)"
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
