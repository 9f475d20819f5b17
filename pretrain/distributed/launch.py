"""torchrun as slurm/pretrain.sbatch runs it: the same launcher (``torch.distributed.run``), without the launcher's
traceback when a worker fails, and with the worker's exit code.

When a worker exits non-zero, torchrun raises ``ChildFailedError``: after the worker's own one-line error
(``pretrain-train: error: data.tokenizer is empty ...``) Python prints a 40-line traceback and a box, and
torchrun exits 1 whatever the worker said. Here that becomes one line naming the failed ranks and their exit
codes, and the exit status is the first failed worker's (2: a config or input error, 75: checkpointed and asking
to be requeued, 128+N: killed by signal N), so srun and the batch script see what the trainer meant.

A SIGTERM to the launcher itself (Slurm signals every process of the step) makes torchrun stop its workers and
raise ``SignalException`` (exit 1, another traceback); here it ends in one line and the workers' own codes decide
the status (``signal_exit_code``): 75 when they checkpointed for a requeue.

    python -m pretrain.distributed.launch [torchrun options] -m pretrain.train CONFIG run_dir=... [key=value ...]
"""

from __future__ import annotations

import logging
import signal
import sys

REQUEUE_EXIT = 75  # the trainer's "checkpointed, requeue me" (pretrain.train)
REQUEUED = "checkpointed and stopped for a requeue"


def exit_code(failures: dict) -> int:
    """The exit status for torchrun's failures ({global rank: ProcessFailure}): the first failed worker's code,
    128 + N for a worker killed by signal N. Workers killed by SIGTERM count only when nothing else failed: once one
    worker fails torchrun stops the others with SIGTERM, and which of the two it records first is a race (a
    2-worker run without data paths ended 143 instead of the trainer's 2 under load, 2026-11-24)."""
    caused = [f for f in failures.values() if f.exitcode != -signal.SIGTERM] or list(failures.values())
    first = min(caused, key=lambda f: (f.timestamp, f.local_rank))
    return first.exitcode if first.exitcode > 0 else 128 - first.exitcode


def summary(failures: dict) -> str:
    """One line: which ranks failed and how (their own messages are above it in the log)."""
    parts = []
    for rank, f in sorted(failures.items()):
        how = f"exit {f.exitcode}" if f.exitcode >= 0 else f"killed by {_signal_name(-f.exitcode)}"
        parts.append(f"rank {rank} {how}")
    code = exit_code(failures)
    meaning = {2: "a configuration or input error (the worker's message above says which)",
               5: "the data loader's workers died or stalled (the message above says which and why); relaunching "
                  "resumes from the last checkpoint",
               REQUEUE_EXIT: REQUEUED}.get(code, "see the worker's message above")
    return f"[launch] workers stopped: {', '.join(parts)}: {meaning}; exit {code}"


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def signal_exit_code(sig: int, codes: dict[int, int]) -> int:
    """The exit status when torchrun itself got ``sig`` (Slurm's SIGTERM goes to every process of the step) and
    stopped its workers, which exited with ``codes`` ({local rank: Popen returncode}). A worker's own error wins,
    then a worker killed by a signal (it was stuck past torchrun's grace period: its checkpoint is not to be
    trusted), then 75 when every worker checkpointed and asked to be requeued; 0 when they had all finished; with no
    codes recorded, 128 + ``sig`` as for any process ended by a signal."""
    if not codes:
        return 128 + sig
    ordered = [codes[r] for r in sorted(codes)]
    for code in ordered:
        if code > 0 and code != REQUEUE_EXIT:
            return code
    for code in ordered:
        if code < 0:
            return 128 - code
    return REQUEUE_EXIT if REQUEUE_EXIT in ordered else 0


def signal_summary(sig: int, codes: dict[int, int]) -> str:
    """One line for torchrun stopped by ``sig``: how each local worker ended, and the exit status."""
    how = ", ".join(f"local rank {r} " + (f"exit {c}" if c >= 0 else f"killed by {_signal_name(-c)}")
                    for r, c in sorted(codes.items())) or "no worker exit recorded"
    code = signal_exit_code(sig, codes)
    meaning = {REQUEUE_EXIT: REQUEUED, 0: "the workers had finished"}.get(
        code, "see the workers' messages above")
    return f"[launch] {_signal_name(sig)}: torchrun stopped its workers: {how}: {meaning}; exit {code}"


# local rank -> exit code of the workers torchrun stopped because it got a signal (filled by _record_stop_codes)
_STOPPED: dict[int, int] = {}


def _record_stop_codes() -> None:
    """torchrun raises SignalException after it has signalled and reaped its workers, without their exit codes:
    wrap its subprocess context's close to keep them (torch 2.x ``SubprocessContext._close``; without that method
    the launcher falls back to 128 + the signal)."""
    from torch.distributed.elastic.multiprocessing import api

    original = getattr(api.SubprocessContext, "_close", None)
    if original is None or getattr(original, "records_stop_codes", False):
        return

    def _close(self, *args, **kwargs):
        original(self, *args, **kwargs)
        for local_rank, handler in getattr(self, "subprocess_handlers", {}).items():
            code = handler.proc.poll()
            if code is not None:
                _STOPPED[int(local_rank)] = code

    _close.records_stop_codes = True
    api.SubprocessContext._close = _close


class _PlainTracebacks(logging.Filter):
    """Formats a record's traceback with the standard library's formatter before torch's handler sees it.

    torch's log formatter imports ``torch._dynamo`` (sympy and the rest: ~2 s of CPU on an idle machine) to format
    any record that carries an exception. In torchrun that happens in the exit barrier's benign race: the last node
    to arrive completes the barrier, the head node's agent (which hosts the store) leaves at once, and the last
    node's own wait then fails with "Failed to recv" and is logged with its traceback. On a loaded 2-node job that
    import outlasted srun's ``--wait`` and the node was SIGKILLed after its workers had finished (exit 137, stop
    38's CI). The same text is printed; only the import is gone."""

    _formatter = logging.Formatter()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info:
            if not record.exc_text:
                record.exc_text = self._formatter.formatException(record.exc_info)
            record.exc_info = None
        return True


def _plain_tracebacks() -> None:
    """Install ``_PlainTracebacks`` on the handlers torch's elastic loggers write through ("torch.distributed")."""
    for handler in logging.getLogger("torch.distributed").handlers:
        if not any(isinstance(f, _PlainTracebacks) for f in handler.filters):
            handler.addFilter(_PlainTracebacks())


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    _record_stop_codes()
    _plain_tracebacks()
    try:
        torchrun(argv)
    except ChildFailedError as e:
        print(summary(e.failures), file=sys.stderr, flush=True)
        return exit_code(e.failures)
    except SignalException as e:  # SIGTERM from scancel / preemption / requeue: the workers checkpointed (or not)
        print(signal_summary(int(e.sigval), dict(_STOPPED)), file=sys.stderr, flush=True)
        return signal_exit_code(int(e.sigval), dict(_STOPPED))
    return 0


if __name__ == "__main__":
    sys.exit(main())
