"""The run-directory lock's rules, on files (the two-trainer case through the real CLI is in
tests/integration/test_faults.py)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
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


def _beating(run_dir, stop: threading.Event, **holder) -> threading.Thread:
    """A holder on another host that keeps rewriting its lock (its clock far behind ours: never compared)."""
    def beat():  # as RunLock._beat does: rewrite atomically, stop once someone else's token is in the file
        n = 0
        while not stop.wait(0.05):
            try:
                if json.loads((run_dir / LOCK_NAME).read_text())["token"] != "someone":
                    return
            except (OSError, ValueError):
                pass
            n += 1
            tmp = run_dir / ".beat"
            tmp.write_text(json.dumps({"host": holder["host"], "pid": holder["pid"], "job": holder.get("job", ""),
                                       "since": 0, "token": "someone", "beats": n,
                                       "heartbeat": time.time() - 1000}))
            os.replace(tmp, run_dir / LOCK_NAME)
    _plant(run_dir, beats=0, heartbeat=time.time() - 1000, **holder)
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    return thread


def test_live_holder_elsewhere_is_refused_with_its_name(tmp_path, monkeypatch):
    # Its heartbeat time is 1000 s old by our clock, but the lock changes while we watch: it is alive.
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    stop = threading.Event()
    thread = _beating(tmp_path, stop, host="node-7", pid=4242, job="slurm:11")
    try:
        t0 = time.monotonic()
        with pytest.raises(RunDirLocked, match="in use by another trainer: host node-7, pid 4242, job slurm:11, "
                                               "running since .* its heartbeat changed while this trainer watched"):
            RunLock(tmp_path, heartbeat_s=0.2, stale_after_s=5).acquire()
        assert time.monotonic() - t0 < 2  # refused as soon as a change was seen
    finally:
        stop.set()
        thread.join()
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == "someone"  # untouched


def test_live_holder_on_this_host_is_refused_at_once(tmp_path):
    """Refused by its pid, and the message says so (it said the heartbeat was watched, which this host does not
    do, and that a dead holder waits stale_after_s, where this host takes it over at once)."""
    _plant(tmp_path, pid=os.getppid())
    t0 = time.monotonic()
    with pytest.raises(RunDirLocked, match="in use by another trainer.* its pid runs on this host .*a holder that "
                                           "died is taken over at once") as refused:
        RunLock(tmp_path, stale_after_s=30).acquire()
    assert "heartbeat" not in str(refused.value)
    assert time.monotonic() - t0 < 1


@pytest.mark.parametrize("case", ["dead_pid_here", "no_heartbeat_change", "unreadable"])
def test_stale_lock_is_taken_over_with_a_warning(tmp_path, case, monkeypatch):
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    if case == "dead_pid_here":
        _plant(tmp_path, pid=_dead_pid())
        why = "is no longer running on this host"
    elif case == "no_heartbeat_change":  # its heartbeat time is *now* by its clock, but it never changes
        _plant(tmp_path, host="node-7", pid=4242, heartbeat=time.time() + 1000)
        why = "its heartbeat did not change for 1s"
    else:
        tmp_path.mkdir(exist_ok=True)
        (tmp_path / LOCK_NAME).write_text("{torn")
        why = "unreadable"
    lock = RunLock(tmp_path, heartbeat_s=0.05, stale_after_s=1.0)
    warning = lock.acquire()
    assert warning.startswith("warning: took over the lock") and why in warning
    assert json.loads((tmp_path / LOCK_NAME).read_text())["token"] == lock.token
    lock.release()
    assert not (tmp_path / LOCK_NAME).exists()


@pytest.mark.parametrize("env, holder_job", [({"SLURM_JOB_ID": "77"}, "slurm:77"),
                                             ({"SLURM_JOB_ID": "90", "SLURM_ARRAY_JOB_ID": "88",
                                               "SLURM_ARRAY_TASK_ID": "3"}, "slurm:88_3"),
                                             ({"PRETRAIN_JOB_ID": "k8s-run-5"}, "k8s-run-5")])
def test_a_requeue_of_the_same_job_takes_its_lock_over_at_once_from_any_host(tmp_path, monkeypatch, env,
                                                                             holder_job):
    for key in ("SLURM_JOB_ID", "SLURM_ARRAY_JOB_ID", "SLURM_ARRAY_TASK_ID", "PRETRAIN_JOB_ID"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    stop = threading.Event()
    thread = _beating(tmp_path, stop, host="node-7", pid=4242, job=holder_job)  # even while it still beats
    try:
        t0 = time.monotonic()
        lock = RunLock(tmp_path, heartbeat_s=0.05, stale_after_s=300)
        warning = lock.acquire()
        assert time.monotonic() - t0 < 2
    finally:
        stop.set()
        thread.join()
    assert f"job {holder_job}" in warning and "a requeue or restart of it" in warning
    lock.release()


def test_another_job_of_the_same_array_is_not_the_same_job(monkeypatch):
    from pretrain.training.run_lock import job_id

    assert job_id({"SLURM_JOB_ID": "90", "SLURM_ARRAY_JOB_ID": "88", "SLURM_ARRAY_TASK_ID": "3"}) == "slurm:88_3"
    assert job_id({"SLURM_JOB_ID": "91", "SLURM_ARRAY_JOB_ID": "88", "SLURM_ARRAY_TASK_ID": "4"}) == "slurm:88_4"
    assert job_id({}) == ""


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


def test_the_holder_takes_a_moment_of_its_lock_being_unreadable_for_no_takeover(tmp_path, monkeypatch):
    """One failed read of its own lock (an EIO on a soft NFS mount, a torn view) made the heartbeat declare the lock
    lost, and the trainer stopped without saving though nobody had taken it over. A lock that stays unreadable for
    UNREADABLE_BEATS heartbeats is still lost; one taken over reads back with another token at once."""
    from pretrain.training import run_lock

    beat = 0.05
    monkeypatch.setattr(run_lock, "UNREADABLE_BEATS", 40)  # ~2 s: a loaded machine's late sleeps stay inside it
    lock = RunLock(tmp_path, heartbeat_s=beat)
    assert lock.acquire() is None
    path = tmp_path / LOCK_NAME
    good = path.read_text()
    path.write_text("{torn")  # unreadable for a few heartbeats
    time.sleep(4 * beat)
    path.write_text(good)
    time.sleep(4 * beat)
    assert not lock.lost and json.loads(path.read_text())["token"] == lock.token  # still held, still beating
    monkeypatch.setattr(run_lock, "UNREADABLE_BEATS", 3)
    path.write_text("{torn")  # unreadable for good
    deadline = time.monotonic() + 10
    while not lock.lost and time.monotonic() < deadline:
        time.sleep(beat)
    assert lock.lost
    lock.release()
