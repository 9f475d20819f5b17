"""checkpoint/writer.py without DeepSpeed: the digests a writer records equal those of the written files, and rank 0's
writer publishes nothing when another rank's write failed or never finished; a save abandoned by a second Ctrl-C is
removed, and one waited for across a Ctrl-C is still waited for; a rank killed while it writes is given up at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time

import pytest

from pretrain.checkpoint import store
from pretrain.checkpoint import writer as writer_mod
from pretrain.checkpoint.writer import (
    CheckpointWriter,
    SaveJob,
    run_main,
    run_rank,
    write_share,
)


@pytest.mark.parametrize("size", [0, 1000, store.SAMPLE_BLOCK * store.SAMPLE_BLOCKS + 12345])
def test_recorded_digests_equal_those_of_the_written_file(size, tmp_path):
    data = os.urandom(size)
    job = _job(tmp_path, 1)
    job.blobs = [(str(job.tmp_dir / "f.pt"), [data[:size // 3], data[size // 3:]])]
    assert write_share(job) == {"f.pt": store.file_digests(job.tmp_dir / "f.pt")}
    assert (job.tmp_dir / "f.pt").read_bytes() == data


def _job(tmp_path, rank: int, **kw) -> SaveJob:
    ckpt = tmp_path / "checkpoints"
    tmp_dir = ckpt / ".tmp-step_00000004"
    tmp_dir.mkdir(parents=True, exist_ok=True)
    kw.setdefault("world_size", 2)
    job = SaveJob(ckpt_dir=ckpt, step=4, rank=rank, trainer_state={"step": 4}, config_yaml="a: 1\n",
                  blobs=[(str(tmp_dir / f"part_rank{rank}.pt"), [b"x" * 100])], **kw)
    job.deadline = time.monotonic() + 30
    return job


def test_another_ranks_failure_removes_the_partial_tag(tmp_path):
    other = _job(tmp_path, 1)
    other.blobs = [(str(other.tmp_dir / "missing_dir" / "part.pt"), [b"x"])]  # its write fails
    with pytest.raises(FileNotFoundError):
        run_rank(other)
    assert (other.tmp_dir / ".failed-rank1").is_file()
    with pytest.raises(store.CheckpointError, match="rank 1 could not write its files \\(FileNotFoundError"):
        run_main(_job(tmp_path, 0))
    assert not (tmp_path / "checkpoints" / ".tmp-step_00000004").exists()
    assert store.find_latest(tmp_path / "checkpoints") is None


def test_a_rank_that_never_finishes_is_given_up_at_the_deadline(tmp_path):
    job = _job(tmp_path, 0, timeout_s=0.1)
    job.deadline = time.monotonic() + 0.1
    with pytest.raises(store.CheckpointError, match="rank 1 did not finish writing its files in time"):
        run_main(job)
    assert not job.tmp_dir.exists()


class _OneRank:
    is_main, is_distributed, rank, world_size = True, False, 0, 1


def test_a_file_written_after_rank_0_removed_the_failed_tag_goes_too(tmp_path, monkeypatch):
    """The chaos soak's race: rank 0's write fails and it removes the temporary tag while another rank's writer
    still creates a file in it; once every writer stopped (wait), nothing of the failed save is left."""
    job = _job(tmp_path, 0)

    def fail_then_late_file(job, on_published=None):
        (job.tmp_dir / "late_from_rank1.pt").write_bytes(b"x")  # the other rank, after rank 0's cleanup
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(writer_mod, "run_main", fail_then_late_file)
    writer = CheckpointWriter(_OneRank())
    writer.start(job)
    with pytest.raises(store.CheckpointError, match="the partial files were removed"):
        writer.wait()
    assert not job.tmp_dir.exists()


class _Gated:
    """A file's pieces whose writing waits for ``gate``: ``started`` is set when the writer reaches them."""

    def __init__(self):
        self.started, self.gate = threading.Event(), threading.Event()

    def __iter__(self):
        self.started.set()
        assert self.gate.wait(30)
        yield b"y" * 10


def _gated_save(tmp_path, monkeypatch):
    """A one-rank rank-0 job of two files whose first waits for its gate (weights faked: no DeepSpeed files)."""
    monkeypatch.setattr(store, "write_weights",
                        lambda tmp_dir, step, in_thread=False: (tmp_dir / store.WEIGHTS_FILE).write_bytes(b"w"))
    job, gated = _job(tmp_path, 0, world_size=1), _Gated()
    job.blobs = [(str(job.tmp_dir / "a.pt"), gated), (str(job.tmp_dir / "b.pt"), [b"z" * 10])]
    return job, gated


@pytest.mark.parametrize("abandon", [False, True])
def test_an_abandoned_save_stops_before_its_next_file_and_is_removed(abandon, tmp_path, monkeypatch):
    """A second Ctrl-C (``abandon``) while the first file is written: the second is never started and the partial
    tag is removed; the same save not abandoned is published."""
    job, gated = _gated_save(tmp_path, monkeypatch)
    writer = CheckpointWriter(_OneRank())
    writer.start(job)
    assert gated.started.wait(30)
    threading.Timer(0.2, gated.gate.set).start()
    if abandon:
        assert writer.abandon() is None
        assert not job.tmp_dir.exists() and store.find_latest(job.ckpt_dir) is None
        assert writer.abandon() is None and writer.in_flight is None  # nothing left in flight
    else:
        assert writer.wait() == job.ckpt_dir / "step_00000004"
        assert store.find_latest(job.ckpt_dir) == "step_00000004"
        assert (job.ckpt_dir / "step_00000004" / "b.pt").read_bytes() == b"z" * 10


def test_a_save_abandoned_after_its_publish_is_reported_published(tmp_path, monkeypatch):
    job, gated = _gated_save(tmp_path, monkeypatch)
    gated.gate.set()
    writer = CheckpointWriter(_OneRank())
    writer.start(job)
    writer._done.wait(30)  # published before the abandon
    assert writer.abandon() == job.ckpt_dir / "step_00000004"
    assert store.find_latest(job.ckpt_dir) == "step_00000004"


def test_a_ctrl_c_while_waiting_for_the_writer_leaves_the_save_in_flight(tmp_path, monkeypatch):
    """A KeyboardInterrupt that lands while the main thread waits for the writer: on Python 3.11's Thread.join it
    released the running thread's state lock and marked it stopped, so the next wait returned at once and the
    process ended with the write half done. The writer still waits for the whole save afterwards."""
    job, gated = _gated_save(tmp_path, monkeypatch)
    writer = CheckpointWriter(_OneRank())
    writer.start(job)
    assert gated.started.wait(30)

    def interrupt(signum, frame):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.1)
        with pytest.raises(KeyboardInterrupt):
            writer.join()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    assert writer.in_flight == 4
    threading.Timer(0.2, gated.gate.set).start()
    assert writer.close() is None  # waited for the whole save, which published
    assert store.find_latest(job.ckpt_dir) == "step_00000004"


def test_another_ranks_abandoned_save_stops_rank_0s(tmp_path):
    """A second Ctrl-C on another rank: its writer stops and leaves its failure marker, so rank 0's writer (still
    waiting for that rank's files) removes the partial tag instead of waiting out the timeout."""
    other, gated = _job(tmp_path, 1), _Gated()
    other.blobs = [(str(other.tmp_dir / "a.pt"), gated), (str(other.tmp_dir / "b.pt"), [b"z"])]
    writer = CheckpointWriter(_OneRank())
    writer.start(other)
    assert gated.started.wait(30)
    threading.Timer(0.2, gated.gate.set).start()
    assert writer.abandon() is None
    assert "abandoned" in (other.tmp_dir / ".failed-rank1").read_text()
    assert not (other.tmp_dir / "b.pt").exists()
    with pytest.raises(store.CheckpointError, match="rank 1 could not write its files .*abandoned"):
        run_main(_job(tmp_path, 0))
    assert not other.tmp_dir.exists() and store.find_latest(other.ckpt_dir) is None


# ------------------------------------------------------------------------------ a rank killed while it writes

def _record_of(tmp_path, proc, **changes) -> dict:
    """``proc``'s process record as its rank leaves it in the temporary tag, with ``changes``."""
    record = writer_mod.process_record(proc.pid)
    assert record is not None and record["pid"] == proc.pid
    record.update(changes)
    (tmp_path / "checkpoints" / ".tmp-step_00000004" / ".process-rank1.json").write_text(json.dumps(record))
    return record


def _waits_for_rank_1(tmp_path, seconds: float) -> tuple[BaseException, float]:
    """Rank 0's writer for ``_job`` with a deadline ``seconds`` away: its error and how long it took to end."""
    job = _job(tmp_path, 0)
    job.deadline = time.monotonic() + seconds
    t0 = time.monotonic()
    with pytest.raises(store.CheckpointError) as failed:
        run_main(job)
    assert not job.tmp_dir.exists() and store.find_latest(job.ckpt_dir) is None
    return failed.value, time.monotonic() - t0


@pytest.mark.parametrize("how", ["reaped", "zombie"])
def test_a_rank_killed_before_its_marker_is_given_up_within_a_second(how, tmp_path):
    """The OOM killer or a SIGKILL on rank 1 while it writes: rank 0's writer gave up only at distributed.timeout_s
    (torchrun SIGKILLed it first, 30 s after tearing the job down, with the partial tag and the run's lock left).
    Its launcher may not have reaped it yet (a zombie)."""
    _job(tmp_path, 1)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        _record_of(tmp_path, proc)
        proc.kill()
        if how == "reaped":
            proc.wait()
        else:  # wait until the kernel made it a zombie, without reaping it
            deadline = time.monotonic() + 10
            while writer_mod._proc_stat(proc.pid)[0] != "Z":
                assert time.monotonic() < deadline
                time.sleep(0.01)
        error, took = _waits_for_rank_1(tmp_path, 30)
    finally:
        proc.kill()
        proc.wait()
    assert f"rank 1's process (pid {proc.pid}) ended before it finished writing its files" in str(error)
    assert took < 5, took


@pytest.mark.parametrize("record", ["running", "another machine", "another pid namespace", "unreadable"])
def test_a_rank_whose_process_runs_or_cannot_be_told_is_waited_for(record, tmp_path):
    """A process that still runs (a slow disk) is waited for until the deadline; so is one whose end cannot be told
    from here: a pid from another machine or pid namespace names no process here, and a damaged record nothing."""
    _job(tmp_path, 1)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        changes = {"running": {}, "another machine": {"boot": "0" * 32},
                   "another pid namespace": {"pid_ns": 1}, "unreadable": {"pid": "x"}}[record]
        _record_of(tmp_path, proc, **changes)
        if record != "running":
            proc.kill()
            proc.wait()
        error, took = _waits_for_rank_1(tmp_path, 1.5)
    finally:
        proc.kill()
        proc.wait()
    assert "rank 1 did not finish writing its files in time" in str(error)
    assert took >= 1.5


def test_another_process_under_the_ranks_pid_is_not_the_rank(tmp_path):
    """A pid reused since the record was written: the start time tells the new process from the rank's."""
    _job(tmp_path, 1)
    proc = subprocess.Popen(["sleep", "60"])
    try:
        record = _record_of(tmp_path, proc, start=writer_mod.process_record(proc.pid)["start"] - 1)
        error, took = _waits_for_rank_1(tmp_path, 30)
    finally:
        proc.kill()
        proc.wait()
    assert f"(pid {record['pid']}) ended" in str(error) and took < 5


def test_the_process_record_leaves_with_the_marker(tmp_path, monkeypatch):
    """A rank that finished: its record and marker are not part of the published tag."""
    monkeypatch.setattr(store, "write_weights",  # no DeepSpeed files here
                        lambda tmp_dir, step, in_thread=False: (tmp_dir / store.WEIGHTS_FILE).write_bytes(b"w"))
    other = _job(tmp_path, 1)
    (other.tmp_dir / ".process-rank1.json").write_text(json.dumps(writer_mod.process_record()))
    run_rank(other)
    published = run_main(_job(tmp_path, 0))
    assert sorted(p.name for p in published.iterdir() if p.name.startswith(".")) == []
