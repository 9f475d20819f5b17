"""A shard whose bytes changed since preprocessing at the same size (a copy cut by a crash on a filesystem that
preallocates, a crash before the page cache reached the disk: the end reads back as zeros) is refused at open by the
sampled sha256 the manifest records for each .bin and .idx, checked once per set of files as the .idx structure."""

from __future__ import annotations

import json
import os
import re
import shutil

import numpy as np
import pytest

from pretrain.data.indexed import HEADER_BYTES, IndexedDataset
from pretrain.data.shards import ShardedDataset, verify_dataset
from pretrain.fsutil import file_digests


@pytest.fixture
def dataset_dir(tiny_corpus, tmp_path):
    """A fresh copy of the tiny preprocessed train set (no stamp: copytree keeps mtimes, so the stamps are dropped)."""
    return shutil.copytree(tiny_corpus["train"], tmp_path / "train", ignore=shutil.ignore_patterns("index-cache"))


def _overwrite(path, offset: int, data: bytes) -> None:
    """``data`` written over ``path`` at ``offset`` (negative: from the end), the size kept; the mtime moved on
    as a copy moves it (a clock of coarse resolution could otherwise leave it as it was)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset % st.st_size)
        f.write(data)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
    assert path.stat().st_size == st.st_size


def _stamps(directory) -> list:
    return sorted((directory / "index-cache").glob("checked-*.json"))


def test_preprocessing_records_the_sampled_digest_of_every_shard_file(dataset_dir):
    """The manifest names how the digests were taken (64 KiB x 4) and each file's digest is fsutil's."""
    m = json.loads((dataset_dir / "manifest.json").read_text())
    assert m["sampled_sha256"] == {"block": 65536, "blocks": 4} and m["format_version"] == 1
    for entry in m["shards"]:
        for ext in ("bin", "idx"):
            got = file_digests(dataset_dir / f"{entry['name']}.{ext}", full=False, block=65536, blocks=4)
            assert entry[f"{ext}_sampled_sha256"] == got["sampled_sha256"]
    assert (dataset_dir / "shard-00000.bin").stat().st_size > 4 * 65536  # sampled, not read whole


@pytest.mark.parametrize("ext", ["bin", "idx"])
def test_zero_filled_end_is_refused_at_open_naming_the_file(dataset_dir, ext):
    """The last 4 KiB zeroed at the same size: the .bin passed the size and structure checks before and was used;
    now the open fails in one line naming the file and what to do, and no stamp vouches for it. (A zeroed .idx end
    breaks the structure already.)"""
    path = dataset_dir / f"shard-00000.{ext}"
    _overwrite(path, -4096, bytes(4096))
    with pytest.raises(ValueError) as e:
        ShardedDataset(str(dataset_dir))
    message = str(e.value)
    assert str(path) in message and "\n" not in message, message
    if ext == "bin":
        assert "differs from when it was preprocessed" in message and "zero-filled" in message
        assert "copy it again" in message and f"pretrain-preprocess --verify {dataset_dir}" in message
    assert not _stamps(dataset_dir)
    problems = verify_dataset(str(dataset_dir))
    assert len(problems) == 1 and str(path) in problems[0] and "sha256 mismatch" in problems[0], problems


def test_idx_changed_with_its_structure_intact_is_refused(dataset_dir):
    """A document boundary moved by one sentence: a valid index, another dataset; only the digest sees it."""
    path = dataset_dir / "shard-00000.idx"
    shard = IndexedDataset(str(dataset_dir / "shard-00000"))
    n, doc_idx = len(shard), np.array(shard.doc_idx)
    d = int(np.flatnonzero(np.diff(doc_idx) > 1)[0]) + 1  # a boundary that can move up and keep documents non-empty
    del shard
    _overwrite(path, HEADER_BYTES + 8 * n + 8 * d, np.array([doc_idx[d] + 1], "<i8").tobytes())
    IndexedDataset(str(dataset_dir / "shard-00000"))  # structure intact
    with pytest.raises(ValueError, match=r"shard-00000\.idx differs from when it was preprocessed"):
        ShardedDataset(str(dataset_dir))
    assert not _stamps(dataset_dir)


def test_damage_after_a_stamped_open_is_caught_at_the_next_open(dataset_dir, tiny_corpus):
    """The stamp spares the checks only for files of the same size and mtime: a shard copied again (cut, a new
    mtime) after an open is checked, refused, and the stamp stays as it was; the good copy opens again."""
    n = len(ShardedDataset(str(dataset_dir)))
    (stamp,) = _stamps(dataset_dir)
    vouched = stamp.read_bytes()
    path = dataset_dir / "shard-00000.bin"
    _overwrite(path, -3000, bytes(3000))
    with pytest.raises(ValueError, match=r"shard-00000\.bin differs from when it was preprocessed"):
        ShardedDataset(str(dataset_dir))
    assert stamp.read_bytes() == vouched
    shutil.copyfile(os.path.join(tiny_corpus["train"], "shard-00000.bin"), path)
    assert len(ShardedDataset(str(dataset_dir))) == n


def test_manifest_written_before_sampled_digests_opens_as_before(dataset_dir, capsys, recwarn):
    """A dataset preprocessed before the digests were recorded opens, silently, without the check (its shards are
    the user's word, as before); --verify still reads every byte."""
    manifest = dataset_dir / "manifest.json"
    m = json.loads(manifest.read_text())
    del m["sampled_sha256"]
    for entry in m["shards"]:
        del entry["bin_sampled_sha256"], entry["idx_sampled_sha256"]
    manifest.write_text(json.dumps(m))
    assert verify_dataset(str(dataset_dir)) == []
    path = dataset_dir / "shard-00000.bin"
    _overwrite(path, -4096, bytes(4096))
    assert len(ShardedDataset(str(dataset_dir))) == m["num_sequences"]
    assert capsys.readouterr() == ("", "") and not recwarn.list
    problems = verify_dataset(str(dataset_dir))
    assert len(problems) == 1 and f"{path} sha256 mismatch (file changed or corrupt)" in problems[0]


def test_reader_takes_the_block_size_and_count_from_the_manifest(dataset_dir):
    """Digests taken with other parameters (3 blocks of 4 KiB) are checked with those; a malformed sampling entry
    is refused naming the manifest, at open and by --verify."""
    manifest = dataset_dir / "manifest.json"
    m = json.loads(manifest.read_text())
    m["sampled_sha256"] = {"block": 4096, "blocks": 3}
    for entry in m["shards"]:
        for ext in ("bin", "idx"):
            got = file_digests(dataset_dir / f"{entry['name']}.{ext}", full=False, block=4096, blocks=3)
            entry[f"{ext}_sampled_sha256"] = got["sampled_sha256"]
    manifest.write_text(json.dumps(m))
    assert len(ShardedDataset(str(dataset_dir))) == m["num_sequences"] and verify_dataset(str(dataset_dir)) == []
    shutil.rmtree(dataset_dir / "index-cache")
    m["sampled_sha256"] = {"block": 4096, "blocks": 1}
    manifest.write_text(json.dumps(m))
    with pytest.raises(ValueError, match=rf"{re.escape(str(manifest))}: sampled_sha256 is .*pretrain-preprocess"):
        ShardedDataset(str(dataset_dir))
    assert any("sampled_sha256" in p for p in verify_dataset(str(dataset_dir)))


def test_a_stamp_copied_along_with_the_files_does_not_vouch_for_the_copies(dataset_dir, tmp_path):
    """``cp -p`` / ``rsync -a`` keep the mtime and copy index-cache/ too: the stamp (size and mtime) vouched for the
    copy, so a copy whose end was zero-filled at full size (cut by a crash), mtime kept, skipped every check. The
    stamp also records inode and ctime, which no copy keeps."""
    ShardedDataset(str(dataset_dir))  # checked and stamped
    assert _stamps(dataset_dir)
    copy = shutil.copytree(dataset_dir, tmp_path / "copy")  # copy2: mtimes kept, the stamp copied along
    path = copy / "shard-00000.bin"
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(st.st_size - 4096)
        f.write(bytes(4096))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(ValueError, match=re.escape(str(path)) + " differs from when it was preprocessed"):
        ShardedDataset(str(copy))
