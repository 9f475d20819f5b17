"""torchrun as slurm/pretrain.sbatch runs it: the same launcher (``torch.distributed.run``), without the launcher's
traceback when a worker fails, and with the worker's exit code.

When a worker exits non-zero, torchrun raises ``ChildFailedError``: after the worker's own one-line error
(``pretrain-train: error: data.tokenizer is empty ...``) Python prints a 40-line traceback and a box, and
torchrun exits 1 whatever the worker said. Here that becomes one line naming the failed ranks and their exit
codes, and the exit status is the first failed worker's (2: a config or input error, 75: checkpointed and asking
to be requeued, 128+N: killed by signal N), so srun and the batch script see what the trainer meant.

    python -m pretrain.distributed.launch [torchrun options] -m pretrain.train CONFIG run_dir=... [key=value ...]
"""

from __future__ import annotations

import signal
import sys


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
               75: "checkpointed and stopped for a requeue"}.get(code, "see the worker's message above")
    return f"[launch] workers stopped: {', '.join(parts)}: {meaning}; exit {code}"


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except ChildFailedError as e:
        print(summary(e.failures), file=sys.stderr, flush=True)
        return exit_code(e.failures)
    return 0


if __name__ == "__main__":
    sys.exit(main())
