"""The sample index cache: built once per (dataset, budget, rule), memory-mapped by everyone after, rebuilt
when it does not belong or is damaged, never half-written."""

from __future__ import annotations

import pickle
import shutil

import numpy as np
import pytest

from pretrain.config.data import DataConfig, SourceConfig
from pretrain.data.datasets import (
    PretrainDataset,
    build_sample_index,
    index_cache_path,
    load_or_build_sample_index,
)
from pretrain.data.shards import ShardedDataset
from pretrain.data.tokenizer import load_tokenizer


@pytest.fixture
def dataset_dir(tiny_corpus, tmp_path):
    d = tmp_path / "train"
    shutil.copytree(tiny_corpus["train"], d, ignore=shutil.ignore_patterns("index-cache"))
    return d


def test_cache_is_written_once_then_memory_mapped(dataset_dir):
    src = ShardedDataset(str(dataset_dir))
    path = index_cache_path(src, 62)
    assert not path.exists()
    first, end, used = load_or_build_sample_index(src, 62)
    assert used == path and path.is_file() and isinstance(first, np.memmap)
    want = build_sample_index(src.sizes, src.doc_idx, 62)
    assert np.array_equal(first, want[0]) and np.array_equal(end, want[1])
    stamp = path.stat().st_mtime_ns
    first2, _, _ = load_or_build_sample_index(ShardedDataset(str(dataset_dir)), 62)
    assert path.stat().st_mtime_ns == stamp and isinstance(first2, np.memmap)  # reused, not rebuilt
    assert not list(path.parent.glob(".*tmp*"))  # no temporary left behind


def test_another_budget_or_dataset_gets_its_own_cache(dataset_dir, tiny_corpus):
    src = ShardedDataset(str(dataset_dir))
    a = index_cache_path(src, 62)
    assert index_cache_path(src, 30) != a
    assert index_cache_path(ShardedDataset(tiny_corpus["valid"]), 62).name != a.name  # another manifest


@pytest.mark.parametrize("damage", ["truncate", "garbage", "foreign"])
def test_damaged_or_foreign_cache_is_rebuilt_not_used(dataset_dir, damage):
    src = ShardedDataset(str(dataset_dir))
    want = build_sample_index(src.sizes, src.doc_idx, 62)
    path = load_or_build_sample_index(src, 62)[2]
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        path.write_bytes(b"not an npy file" * 10)
    else:  # a well-formed index that points past this dataset
        np.save(path, np.stack([want[0] + 10**9, want[1] + 10**9]))
    first, end, used = load_or_build_sample_index(ShardedDataset(str(dataset_dir)), 62)
    assert used == path and np.array_equal(first, want[0]) and np.array_equal(end, want[1])


def test_read_only_dataset_falls_back_to_memory(dataset_dir, monkeypatch):
    src = ShardedDataset(str(dataset_dir))
    real_replace = __import__("os").replace

    def refuse(a, b):
        raise PermissionError(13, "Permission denied", str(b))

    monkeypatch.setattr("pretrain.data.datasets.os.replace", refuse)
    first, end, used = load_or_build_sample_index(src, 62)
    monkeypatch.setattr("pretrain.data.datasets.os.replace", real_replace)
    assert used is None and not isinstance(first, np.memmap) and len(first) > 0
    assert not list(index_cache_path(src, 62).parent.glob(".*tmp*"))


def test_workers_receive_the_index_by_path_not_by_copy(dataset_dir, tiny_corpus):
    tok = load_tokenizer(tiny_corpus["tokenizer"])
    cfg = DataConfig(tokenizer=tiny_corpus["tokenizer"], sources=[SourceConfig(name="d", path=str(dataset_dir))],
                     max_len=64, view_max_len=32)
    ds = PretrainDataset(ShardedDataset(str(dataset_dir)), tok, cfg, seed=1)
    blob = pickle.dumps(ds)
    assert len(blob) < ds.first_N.nbytes  # the arrays did not travel
    clone = pickle.loads(blob)
    assert isinstance(clone.first_N, np.memmap) and len(clone) == len(ds)
    a, b = ds[(0, 5)], clone[(0, 5)]
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_shard_by_shard_index_equals_the_global_one(tiny_corpus, tmp_path):
    """Built from each shard's memory-mapped sizes (no corpus-sized copy) and written part by part into the
    cache file, the index is the global packing."""
    from pretrain.data.datasets import load_or_build_sample_index
    from pretrain.data.preprocess import preprocess

    text = tmp_path / "text.txt"
    shutil.copyfile(f"{tiny_corpus['dir']}/text/train.txt", text)
    preprocess([str(text)], str(tmp_path / "many"), tiny_corpus["tokenizer"], num_workers=1,
               shard_size_tokens=20_000)
    src = ShardedDataset(str(tmp_path / "many"))
    assert len(src.shards) > 3
    got = load_or_build_sample_index(src, 62)
    assert got[2] is not None and got[2].is_file()  # cached
    assert "sizes" not in vars(src)  # the global copy was never made
    want = build_sample_index(src.sizes, src.doc_idx, 62)
    assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1])


def test_structural_check_runs_once_per_set_of_files(tiny_corpus, tmp_path, monkeypatch):
    """The O(N) .idx scan runs on the first open and again only for a shard whose files changed; a damaged
    .idx written after the stamp is still caught."""
    from pretrain.data import indexed

    shutil.copytree(tiny_corpus["train"], tmp_path / "ds")
    shutil.rmtree(tmp_path / "ds" / "index-cache", ignore_errors=True)  # copytree kept mtimes: drop the stamps
    calls = []
    real = indexed.IndexedDataset._check
    monkeypatch.setattr(indexed.IndexedDataset, "_check", lambda self, p, *a: (calls.append(p), real(self, p, *a)))
    ShardedDataset(str(tmp_path / "ds"))
    first = len(calls)
    assert first >= 1
    ShardedDataset(str(tmp_path / "ds"))
    assert len(calls) == first  # warm: stamp matches, no scan
    idx = sorted((tmp_path / "ds").glob("shard-*.idx"))[0]
    raw = bytearray(idx.read_bytes())
    raw[-8:] = b"\xff" * 8  # a size field at the end: the offsets no longer tile the .bin
    idx.write_bytes(bytes(raw))
    with pytest.raises(ValueError, match="corrupt"):
        ShardedDataset(str(tmp_path / "ds"))
