"""checkpoint/writer.py without DeepSpeed: the digests a writer records equal those of the written files, and rank 0's
writer publishes nothing when another rank's write failed or never finished."""

from __future__ import annotations

import os
import time

import pytest

from pretrain.checkpoint import store
from pretrain.checkpoint.writer import SaveJob, run_main, run_rank, write_share


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
