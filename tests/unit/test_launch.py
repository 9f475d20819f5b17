"""pretrain.distributed.launch: torchrun's failures -> one line and the first failed worker's exit code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

from pretrain.distributed.launch import exit_code, signal_exit_code, signal_summary, summary


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


def test_a_signalled_torchrun_exits_with_what_its_workers_did():
    term = int(signal.SIGTERM)
    assert signal_exit_code(term, {0: 75, 1: 75}) == 75  # every worker checkpointed: requeue me
    assert signal_exit_code(term, {0: 75, 1: 2}) == 2  # a worker's own error wins
    assert signal_exit_code(term, {0: 75, 1: -9}) == 137  # one was SIGKILLed past the grace period
    assert signal_exit_code(term, {0: 0, 1: 0}) == 0  # they had finished
    assert signal_exit_code(term, {}) == 143  # nothing recorded: as any process ended by SIGTERM
    assert signal_summary(term, {1: -9, 0: 75}) == (
        "[launch] SIGTERM: torchrun stopped its workers: local rank 0 exit 75, local rank 1 killed by SIGKILL: see "
        "the workers' messages above; exit 137")


WORKER_75 = """import os, signal, sys, time
from pathlib import Path
def stop(*_):
    time.sleep(0.5)  # a checkpoint being written
    print(f"worker {os.environ['LOCAL_RANK']}: checkpointed, exit 75", file=sys.stderr, flush=True)
    os._exit(75)
signal.signal(signal.SIGTERM, stop)
Path(sys.argv[1], "ready-" + os.environ["LOCAL_RANK"]).touch()
while True:
    time.sleep(0.1)
"""


def test_sigterm_to_the_launcher_ends_in_the_workers_requeue_code_not_a_traceback(tmp_path):
    """Slurm's SIGTERM reaches torchrun too: it forwards it, its workers checkpoint and exit 75, and the launcher
    must exit 75 (the batch script's "stopped for a requeue"), not torchrun's 1 and a SignalException traceback."""
    worker = tmp_path / "worker.py"
    worker.write_text(WORKER_75)
    proc = subprocess.Popen([sys.executable, "-m", "pretrain.distributed.launch", "--nproc-per-node=2", str(worker),
                             str(tmp_path)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not all((tmp_path / f"ready-{r}").exists() for r in (0, 1)):
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 75, err
    assert err.count("checkpointed, exit 75") == 2, err
    assert ("[launch] SIGTERM: torchrun stopped its workers: local rank 0 exit 75, local rank 1 exit 75: "
            "checkpointed and stopped for a requeue; exit 75") in err
    assert "Traceback" not in err and "SignalException" not in err, err


LATE_NODE = """import os, socket, sys, time
import torch.distributed.elastic.utils.store as store_util
joined = store_util._barrier_nonblocking
def join_then_stall(*args, **kwargs):  # node 1 joins the exit barrier, then is descheduled before it waits
    key = joined(*args, **kwargs)
    if os.environ["NODE"] == "1":  # ... until the head node has left and its store is closed
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", int(os.environ["PORT"])), timeout=1).close()
            except OSError:
                break
            time.sleep(0.05)
    return key
store_util._barrier_nonblocking = join_then_stall
from pretrain.distributed.launch import main
code = main(sys.argv[1:])
print(f"node {os.environ['NODE']}: torch._dynamo imported: {'torch._dynamo' in sys.modules}", file=sys.stderr)
sys.exit(code)
"""


def test_the_exit_barriers_race_is_logged_without_importing_dynamo(tmp_path):
    """Two nodes' torchrun on localhost. Node 1 completes the exit barrier, and the head node (which hosts the store)
    leaves before node 1 waits on it: torch logs node 1's "Failed to recv" with its traceback. torch's formatter
    imports torch._dynamo for any traceback, seconds of CPU, and on a loaded 2-node Slurm job that outlasted srun's
    --wait and node 1 was SIGKILLed after training had finished (stop 38's CI). The traceback is still printed."""
    import socket

    (tmp_path / "late_node.py").write_text(LATE_NODE)
    (tmp_path / "worker.py").write_text("print('worker done')\n")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [subprocess.Popen([sys.executable, str(tmp_path / "late_node.py"), "--nnodes=2", f"--node-rank={n}",
                               "--nproc-per-node=1", "--master-addr=127.0.0.1", f"--master-port={port}",
                               "--max-restarts=0", str(tmp_path / "worker.py")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "NODE": str(n), "PORT": str(port)})
             for n in (0, 1)]
    try:
        errs = [p.communicate(timeout=180)[1] for p in procs]
    finally:
        for p in procs:
            p.kill()
    assert [p.returncode for p in procs] == [0, 0], errs
    assert "Error waiting on exit barrier" in errs[1] and "Failed to recv" in errs[1], errs[1]  # the race happened
    assert "Traceback (most recent call last)" in errs[1]  # and its traceback is still there
    assert "node 1: torch._dynamo imported: False" in errs[1], errs[1]
    assert "node 0: torch._dynamo imported: False" in errs[0], errs[0]
