"""checkpoint/writer.py without DeepSpeed: the digests a writer records equal those of the written files, and rank 0's
writer publishes nothing when another rank's write failed or never finished."""

from __future__ import annotations

import os
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
    job = SaveJob(ckpt_dir=ckpt, step=4, rank=rank, world_size=2, trainer_state={"step": 4}, config_yaml="a: 1\n",
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
