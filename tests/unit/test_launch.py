"""pretrain.distributed.launch: torchrun's failures -> one line and the first failed worker's exit code."""

from __future__ import annotations

import subprocess
import sys

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from pretrain.distributed.launch import exit_code, summary


def _failure(local_rank: int, code: int, ts: int) -> ProcessFailure:
    f = ProcessFailure(local_rank=local_rank, pid=100 + local_rank, exitcode=code, error_file="<N/A>")
    f.timestamp = ts
    return f


def test_the_first_failure_decides_the_exit_code():
    assert exit_code({0: _failure(0, 75, 5), 1: _failure(1, 75, 6)}) == 75
    assert exit_code({0: _failure(0, -15, 7), 1: _failure(1, 2, 6)}) == 2
    assert exit_code({0: _failure(0, -9, 1)}) == 137
    # torchrun's SIGTERM of the other worker recorded first (a race): the worker's own exit still decides
    assert exit_code({0: _failure(0, -15, 5), 1: _failure(1, 2, 6)}) == 2
    assert exit_code({0: _failure(0, -15, 5), 1: _failure(1, -15, 6)}) == 143  # a SIGTERM of everyone stays one
    assert exit_code({0: _failure(0, -9, 5), 1: _failure(1, 1, 6)}) == 137  # another signal first is the cause
    line = summary({0: _failure(0, 2, 1), 1: _failure(1, -15, 2)})
    assert line == ("[launch] workers stopped: rank 0 exit 2, rank 1 killed by SIGTERM: a configuration or input "
                    "error (the worker's message above says which); exit 2")


def test_a_worker_error_ends_in_one_line_not_a_traceback(tmp_path):
    """A real torchrun launch of a worker that fails: its own line, the launcher's line, the worker's code."""
    worker = tmp_path / "worker.py"
    worker.write_text("import sys\nprint('worker: error: data.tokenizer is empty', file=sys.stderr)\nsys.exit(2)\n")
    proc = subprocess.run([sys.executable, "-m", "pretrain.distributed.launch", "--nproc-per-node=1", str(worker)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "worker: error: data.tokenizer is empty" in proc.stderr
    assert "[launch] workers stopped: rank 0 exit 2" in proc.stderr
    assert "Traceback" not in proc.stderr and "ChildFailedError" not in proc.stderr, proc.stderr
