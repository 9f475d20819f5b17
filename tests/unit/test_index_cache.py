"""The sample index cache: built once per (dataset, budget, rule), memory-mapped by everyone after, rebuilt
when it does not belong or is damaged, never half-written."""

from __future__ import annotations

import pickle
import shutil

import numpy as np
import pytest

from pretrain.config.data import DataConfig, SourceConfig
from pretrain.data.datasets import PretrainDataset
from pretrain.data.sample_index import (
    build_sample_index,
    index_cache_path,
    load_or_build_sample_index,
)
from pretrain.data.shards import ShardedDataset
from pretrain.prep.tokenizer import load_tokenizer


def assert_same_samples(index, src, want) -> None:
    """The SampleIndex holds the packer's samples: the same first sentences, and ranges that give the same
    tokens (an end may run on over empty sentences only) without leaving the sample's shard."""
    first, end = index.ranges(np.arange(len(index)))
    assert len(index) == len(want[0]) and np.array_equal(first, want[0])
    cum = np.concatenate([[0], np.cumsum(np.asarray(src.sizes, dtype=np.int64))])
    assert (end >= want[1]).all() and np.array_equal(cum[end], cum[want[1]])
    bounds = getattr(src, "starts", np.array([0, len(src)]))
    shard = np.searchsorted(bounds, first, side="right")
    assert (end <= bounds[shard]).all()


@pytest.fixture
def dataset_dir(tiny_corpus, tmp_path):
    d = tmp_path / "train"
    shutil.copytree(tiny_corpus["train"], d, ignore=shutil.ignore_patterns("index-cache"))
    return d


def test_cache_is_written_once_then_memory_mapped(dataset_dir):
    src = ShardedDataset(str(dataset_dir))
    path = index_cache_path(src, 62)
    assert not path.exists()
    index = load_or_build_sample_index(src, 62)
    assert index.path == path and path.is_file() and isinstance(index.starts, np.memmap)
    assert_same_samples(index, src, build_sample_index(src.sizes, src.doc_idx, 62))
    assert path.stat().st_size == 128 + 8 * (len(index) + 1)  # N + 1 starts, cut to size after the sparse worst case
    stamp = path.stat().st_mtime_ns
    index2 = load_or_build_sample_index(ShardedDataset(str(dataset_dir)), 62)
    assert path.stat().st_mtime_ns == stamp and isinstance(index2.starts, np.memmap)  # reused, not rebuilt
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
    path = load_or_build_sample_index(src, 62).path
    raw = path.read_bytes()
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) // 2])
    elif damage == "garbage":
        path.write_bytes(b"not an npy file" * 10)
    else:  # a well-formed index that points past this dataset
        np.save(path, np.append(want[0], want[1][-1]) + 10**9)
    index = load_or_build_sample_index(ShardedDataset(str(dataset_dir)), 62)
    assert index.path == path
    assert_same_samples(index, src, want)


def test_read_only_dataset_falls_back_to_memory(dataset_dir, monkeypatch):
    src = ShardedDataset(str(dataset_dir))
    real_replace = __import__("os").replace

    def refuse(a, b):
        raise PermissionError(13, "Permission denied", str(b))

    monkeypatch.setattr("pretrain.data.sample_index.os.replace", refuse)
    index = load_or_build_sample_index(src, 62)
    monkeypatch.setattr("pretrain.data.sample_index.os.replace", real_replace)
    assert index.path is None and not isinstance(index.starts, np.memmap) and len(index) > 0
    assert_same_samples(index, src, build_sample_index(src.sizes, src.doc_idx, 62))
    assert not list(index_cache_path(src, 62).parent.glob(".*tmp*"))


def test_workers_receive_the_index_by_path_not_by_copy(dataset_dir, tiny_corpus):
    tok = load_tokenizer(tiny_corpus["tokenizer"])
    cfg = DataConfig(tokenizer=tiny_corpus["tokenizer"], sources=[SourceConfig(name="d", path=str(dataset_dir))],
                     max_len=64, view_max_len=32)
    ds = PretrainDataset(ShardedDataset(str(dataset_dir)), tok, cfg, seed=1)
    blob = pickle.dumps(ds)
    assert len(blob) < ds.index.starts.nbytes  # the arrays did not travel
    clone = pickle.loads(blob)
    assert isinstance(clone.index.starts, np.memmap) and len(clone) == len(ds)
    a, b = ds[(0, 5)], clone[(0, 5)]
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_shard_by_shard_index_equals_the_global_one(tiny_corpus, tmp_path):
    """Built from each shard's memory-mapped sizes (no corpus-sized copy) and written part by part into the
    cache file, the index is the global packing."""
    from pretrain.data.sample_index import load_or_build_sample_index
    from pretrain.prep.preprocess import preprocess

    text = tmp_path / "text.txt"
    shutil.copyfile(f"{tiny_corpus['dir']}/text/train.txt", text)
    preprocess([str(text)], str(tmp_path / "many"), tiny_corpus["tokenizer"], num_workers=1,
               shard_size_tokens=20_000)
    src = ShardedDataset(str(tmp_path / "many"))
    assert len(src.shards) > 3
    got = load_or_build_sample_index(src, 62)
    assert got.path is not None and got.path.is_file()  # cached
    assert "sizes" not in vars(src)  # the global copy was never made
    assert_same_samples(got, src, build_sample_index(src.sizes, src.doc_idx, 62))


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


def test_starts_layout_on_shards_with_empty_sentences(tmp_path):
    """Shards whose documents start or end with empty sentences, an all-empty shard, a shard of one empty
    document: the cache file (one pass into a sparse worst-case file, then cut) and the in-memory index give
    the packer's samples, and no range runs into the next shard."""
    from types import SimpleNamespace

    from pretrain.data.sample_index import _write_index

    rng = np.random.default_rng(7)
    shards = []
    for k in range(6):
        lens = rng.integers(1, 9, size=int(rng.integers(1, 6)))
        n = int(lens.sum())
        sizes = rng.integers(1, 30, size=n) * (rng.random(n) > 0.35)
        if k == 2:
            sizes[:] = 0  # all empty
        sizes[0] = 0  # leading empty sentence
        shards.append(SimpleNamespace(sizes=sizes.astype(np.int32),
                                      doc_idx=np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)))
    shards.append(SimpleNamespace(sizes=np.zeros(1, np.int32), doc_idx=np.array([0, 1], np.int64)))
    starts = np.concatenate([[0], np.cumsum([len(s.sizes) for s in shards])]).astype(np.int64)

    class Src(SimpleNamespace):  # what the index reads of a ShardedDataset, without a manifest
        def __len__(self):
            return int(starts[-1])

    src = Src(shards=shards, starts=starts, sizes=np.concatenate([s.sizes for s in shards]))
    doc = np.concatenate([s.doc_idx[:-1] + o for s, o in zip(shards, starts)] + [starts[-1:]])
    want = build_sample_index(src.sizes, doc, 40)
    memory = load_or_build_sample_index(src, 40)  # no manifest: in memory
    assert memory.path is None
    assert_same_samples(memory, src, want)
    path = tmp_path / "index.npy"
    _write_index(path, src, 40)
    on_disk = np.load(path, mmap_mode="r")
    assert np.array_equal(on_disk, memory.starts) and path.stat().st_size == 128 + 8 * len(on_disk)


def test_sentence_index_is_cached_sliced_and_sent_by_path(tmp_path, monkeypatch):
    """The sentence stage's index of non-empty sentences: the positions flatnonzero(sizes > 0) gives, built shard
    by shard in slices into the cache file (no corpus-sized array), memory-mapped after, sent to workers by path;
    a damaged or foreign cache is rebuilt; an all-empty source is an empty index; without a manifest, in memory."""
    from types import SimpleNamespace

    from pretrain.data import sample_index
    from pretrain.data.sample_index import load_or_build_sentence_index

    monkeypatch.setattr(sample_index, "_SCAN", 5)  # several slices per shard
    rng = np.random.default_rng(3)
    shards = [SimpleNamespace(sizes=(rng.integers(1, 9, size=n) * (rng.random(n) > 0.3)).astype(np.int32),
                              doc_idx=None) for n in (17, 1, 0, 23, 6)]
    starts = np.concatenate([[0], np.cumsum([len(s.sizes) for s in shards])]).astype(np.int64)

    class Src(SimpleNamespace):
        def __len__(self):
            return int(starts[-1])

    (tmp_path / "index-cache").mkdir()
    src = Src(shards=shards, starts=starts, directory=str(tmp_path), manifest_digest="d1")
    want = np.flatnonzero(np.concatenate([s.sizes for s in shards]) > 0)
    index = load_or_build_sentence_index(src)
    assert isinstance(index.positions, np.memmap) and index.path.name == "sentences-d1-nonempty-v1.npy"
    assert np.array_equal(index.positions, want) and len(index) == len(want) and index[3] == want[3]
    assert index.path.stat().st_size == 128 + 8 * len(want) and not list(index.path.parent.glob(".*tmp*"))
    blob = pickle.dumps(index)
    assert len(blob) < want.nbytes and np.array_equal(pickle.loads(blob).positions, want)
    stamp = index.path.stat().st_mtime_ns
    assert load_or_build_sentence_index(src).path.stat().st_mtime_ns == stamp  # reused
    for damage in (b"junk" * 3, None):
        if damage is None:
            np.save(index.path, want + len(src))  # well-formed, but past this dataset's end
        else:
            index.path.write_bytes(damage)
        assert np.array_equal(load_or_build_sentence_index(src).positions, want)
    assert np.array_equal(load_or_build_sentence_index(Src(shards=shards, starts=starts)).positions, want)
    all_empty = Src(shards=[SimpleNamespace(sizes=np.zeros(len(src), np.int32), doc_idx=None)],
                    starts=starts[[0, -1]], directory=str(tmp_path), manifest_digest="d2")
    assert len(load_or_build_sentence_index(all_empty)) == 0


def test_sentence_dataset_reads_a_preprocessed_directory_through_the_cached_index(dataset_dir, tiny_corpus):
    from pretrain.config.objective import ObjectiveConfig
    from pretrain.data.sentences import SentenceDataset

    tok = load_tokenizer(tiny_corpus["tokenizer"])
    cfg = DataConfig(tokenizer=tiny_corpus["tokenizer"], max_len=64, view_max_len=32)
    ds = SentenceDataset(str(dataset_dir), tok, cfg, ObjectiveConfig(), seed=1)
    src = ShardedDataset(str(dataset_dir))
    nonempty = np.flatnonzero(np.asarray(src.sizes) > 0)
    assert len(ds) == len(nonempty) and isinstance(ds.index_N.positions, np.memmap)
    for i in (0, len(ds) // 2, len(ds) - 1):
        assert np.array_equal(ds.tokens(i), np.asarray(src[int(nonempty[i])]))
    clone = pickle.loads(pickle.dumps(ds))
    assert all(np.array_equal(a, b) for a, b in zip(clone[(0, 3)].values(), ds[(0, 3)].values()))


def test_index_cache_dir_keeps_every_cache_out_of_a_read_only_dataset(dataset_dir, tiny_corpus, tmp_path):
    """data.index_cache_dir: a dataset in a read-only project space still gets memory-mapped caches shared by the
    ranks (not an in-RAM index per rank): the sample index, the sentence index and the shard-check stamp all go to
    that directory (made with its parents), the dataset directory is left untouched, workers get the place with
    the pickled dataset, and a second open reuses what the first wrote."""
    from pretrain.config.objective import ObjectiveConfig
    from pretrain.data.datasets import build_dataset
    from pretrain.data.sentences import SentenceDataset

    before = sorted(p.relative_to(dataset_dir) for p in dataset_dir.rglob("*"))
    cache = tmp_path / "scratch" / "pretrain-index"
    tok = load_tokenizer(tiny_corpus["tokenizer"])
    cfg = DataConfig(tokenizer=tiny_corpus["tokenizer"], sources=[SourceConfig(name="d", path=str(dataset_dir))],
                     max_len=64, view_max_len=32, index_cache_dir=str(cache))
    ds = build_dataset(cfg, tok, seed=1)
    sentences = SentenceDataset(str(dataset_dir), tok, cfg, ObjectiveConfig(), seed=1)
    assert sorted(p.relative_to(dataset_dir) for p in dataset_dir.rglob("*")) == before  # nothing written there
    names = sorted(p.name.split("-")[0] for p in cache.iterdir())
    assert names == ["checked", "samples", "sentences"], names
    assert ds.index.path.parent == cache and isinstance(ds.index.starts, np.memmap)
    assert sentences.index_N.path.parent == cache and isinstance(sentences.index_N.positions, np.memmap)
    clone = pickle.loads(pickle.dumps(ds))
    assert clone.index.path == ds.index.path and clone.source.cache_dir == cache
    stamps = {p.name: p.stat().st_mtime_ns for p in cache.iterdir()}
    again = build_dataset(cfg, tok, seed=1)
    assert {p.name: p.stat().st_mtime_ns for p in cache.iterdir()} == stamps  # reused, not rebuilt
    default = build_dataset(DataConfig(tokenizer=tiny_corpus["tokenizer"], max_len=64, view_max_len=32,
                                       sources=cfg.sources), tok, seed=1)
    assert default.index.path.parent == dataset_dir / "index-cache"
    assert np.array_equal(np.asarray(default.index.starts), np.asarray(again.index.starts))
