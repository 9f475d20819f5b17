"""The run-directory lock's rules, on files (the two-trainer case through the real CLI is in
tests/integration/test_faults.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time

import pytest

from pretrain.training.run_lock import LOCK_NAME, RunDirLocked, RunLock


def _plant(run_dir, **holder):
    run_dir.mkdir(parents=True, exist_ok=True)
    base = {"host": socket.gethostname(), "pid": os.getpid(), "since": time.time(), "heartbeat": time.time(),
            "token": "someone"}
    (run_dir / LOCK_NAME).write_text(json.dumps(dict(base, **holder)))


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_live_holder_elsewhere_is_refused_with_its_name(tmp_path):
    _plant(tmp_path, host="node-7", pid=4242)
    with pytest.raises(RunDirLocked, match="in use by another trainer: host node-7, pid 4242, running since .* "
                                           "last heartbeat 0s ago"):
        RunLock(tmp_path).acquire()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == "someone"  # untouched


@pytest.mark.parametrize("case", ["dead_pid_here", "no_heartbeat", "unreadable"])
def test_stale_lock_is_taken_over_with_a_warning(tmp_path, case):
    if case == "dead_pid_here":
        _plant(tmp_path, pid=_dead_pid())
        why = "is no longer running on this host"
    elif case == "no_heartbeat":
        _plant(tmp_path, host="node-7", pid=4242, heartbeat=time.time() - 1000)
        why = "no heartbeat for"
    else:
        tmp_path.mkdir(exist_ok=True)
        (tmp_path / LOCK_NAME).write_text("{torn")
        why = "unreadable"
    lock = RunLock(tmp_path, heartbeat_s=0.05)
    warning = lock.acquire()
    assert warning.startswith("warning: took over the lock") and why in warning
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.token
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


def test_heartbeat_refreshes_and_notices_a_takeover(tmp_path):
    lock = RunLock(tmp_path, heartbeat_s=0.05)
    assert lock.acquire() is None
    first = json.loads((tmp_path / LOCK_NAME).read_text())["heartbeat"]
    time.sleep(0.3)
    assert json.loads((tmp_path / LOCK_NAME).read_text())["heartbeat"] > first
    _plant(tmp_path, host="node-7", pid=4242)  # someone else took it over
    time.sleep(0.3)
    assert lock.lost
    lock.release()
    assert (tmp_path / LOCK_NAME).exists()  # not ours any more: left alone
