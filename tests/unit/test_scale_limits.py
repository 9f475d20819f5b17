"""What breaks at cluster scale (1e9 sentences, 3e10 tokens, hundreds of shards, 64 ranks) and not in small tests,
checked without a big dataset: sparse files stand in for huge shards, fake shards for many, large numbers are
passed to the index and order functions directly."""

from __future__ import annotations

import gc
import os
import struct
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

from pretrain.data.indexed import MAGIC, VERSION, IndexedDatasetBuilder
from pretrain.data.loader import RankBatchSampler, SampleOrder
from pretrain.data.sample_index import build_sample_index, load_or_build_sample_index
from pretrain.data.shards import ShardedDataset, write_manifest

VOCAB = 1000


def _manifest(directory, shards: list[dict]) -> None:
    write_manifest(directory, {
        "tokenizer": {"path": "tok.json", "sha256": "0" * 64, "kind": "wordpiece", "vocab_size": VOCAB,
                      "lowercase": True},
        "dtype": "uint16", "shards": shards,
        "num_sequences": sum(s["num_sequences"] for s in shards),
        "num_documents": sum(s["num_documents"] for s in shards),
        "num_tokens": sum(s["num_tokens"] for s in shards)})


def _small_shards(directory, count: int) -> None:
    shards = []
    for k in range(count):
        b = IndexedDatasetBuilder(str(directory / f"shard-{k:05d}"), VOCAB)
        b.add_documents(np.arange(k, k + 6) % VOCAB, np.array([2, 4]), np.array([2]))
        shards.append({"name": f"shard-{k:05d}", **b.finalize()})
    _manifest(directory, shards)


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd")
def test_open_shards_hold_no_file_descriptor_each(tmp_path):
    """np.memmap keeps a descriptor per map (Python's mmap dups it): 2 a shard, so 600 shards (3e10 tokens at the
    default 5e7 a shard) took 1200 per process, past the common soft limit of 1024 ("Too many open files" when
    the dataset opens). The maps must not hold descriptors: opening many shards costs a constant few."""
    _small_shards(tmp_path, 40)
    before = _open_fds()
    ds = ShardedDataset(str(tmp_path))
    assert _open_fds() - before < 5
    assert ds[0].tolist() == [0, 1] and ds[len(ds) - 1].tolist() == [41, 42, 43, 44]
    ids, lens = ds.token_batch(np.array([1, 78]), np.array([2, 80]), 10)
    assert ids[0, :4].tolist() == [2, 3, 4, 5] and lens.tolist() == [4, 6] and ids[1].tolist() == list(range(39, 45))
    views = [ds.shards[3].offsets, ds.shards[3]._bin[:2]]
    assert not views[0].flags.writeable and not views[1].flags.writeable
    del ds
    gc.collect()
    assert views[0].tolist() == [0, 2] and views[1].tolist() == [3, 4]  # a view keeps its map alive


def _huge_shard(prefix, sizes: list[int], tail: dict[int, int]) -> int:
    """A shard of ``sizes`` (one document) whose .bin is a sparse file, token ``t`` holding ``tail[t]``;
    written by hand per FORMAT.md (the builder streams real bytes). Returns num_tokens."""
    n, num_tokens = len(sizes), int(sum(sizes))
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype("<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(struct.pack("<8sIIQQQ", MAGIC, VERSION, 2, n, 1, num_tokens))
        f.write(offsets.tobytes() + np.array([0, n], "<i8").tobytes() + np.asarray(sizes, "<i4").tobytes())
    with open(f"{prefix}.bin", "wb") as f:
        f.truncate(2 * num_tokens)
        for t, v in tail.items():
            f.seek(2 * t)
            f.write(struct.pack("<H", v))
    return num_tokens


def test_token_offsets_past_2_31_and_2_32(tmp_path):
    """A shard of 2**32 + 12 tokens (8 GiB sparse): offsets, gathers and the sample index stay exact (int64 in
    FORMAT.md and in every reader), and a second shard's sentences keep their global numbers."""
    big = [2**31 - 1, 2**31 - 1, 7, 5, 2]
    n_tok = _huge_shard(tmp_path / "shard-00000", big, {2**32 - 2: 11, 2**32 + 4: 12, 2**32 + 5: 13,
                                                        2**32 + 11: 14})
    b = IndexedDatasetBuilder(str(tmp_path / "shard-00001"), VOCAB)
    b.add_documents(np.array([21, 22, 23]), np.array([3]), np.array([1]))
    small = b.finalize()
    _manifest(tmp_path, [{"name": "shard-00000", "num_sequences": 5, "num_documents": 1, "num_tokens": n_tok},
                         {"name": "shard-00001", **small}])
    ds = ShardedDataset(str(tmp_path))
    assert ds.num_tokens == 2**32 + 15 and int(ds.shards[0].offsets[4]) == 2**32 + 10
    assert ds[2].tolist() == [11, 0, 0, 0, 0, 0, 12] and ds[3].tolist() == [13, 0, 0, 0, 0]
    assert ds[4].tolist() == [0, 14] and ds[5].tolist() == [21, 22, 23]
    ids, lens = ds.token_batch(np.array([2, 3, 5]), np.array([4, 5, 6]), 8)
    assert lens.tolist() == [8, 7, 3]
    assert ids[0].tolist() == [11, 0, 0, 0, 0, 0, 12, 13] and ids[1, :7].tolist() == [13, 0, 0, 0, 0, 0, 14]
    assert ids[2, :3].tolist() == [21, 22, 23]
    index = load_or_build_sample_index(ds, 12)  # cached in index-cache/
    assert [index.range(k) for k in range(len(index))] == [(0, 1), (1, 2), (2, 4), (4, 5), (5, 6)]


def test_sample_order_is_a_permutation_past_2_32_samples():
    """feistel-v1 at N past 2**31 / 2**32 (a blend of sentence datasets, or a tiny budget): every position maps
    into [0, N), distinct positions to distinct samples, and positions past 2**31 in the stream (1e6 steps x
    64 ranks x 256) locate to the right epoch."""
    for n in (2**31 + 7, 2**32 + 3, 3 * 10**10 + 1):
        order = SampleOrder(n, seed=7)
        pos = np.concatenate([np.arange(50_000), n - 1 - np.arange(50_000),
                              np.random.default_rng(0).integers(0, n, 50_000)])
        got = order.indices(3, pos)
        assert got.min() >= 0 and got.max() < n and len(np.unique(got)) == len(np.unique(pos))
    order = SampleOrder(2 * 10**8, seed=1)
    stream = np.array([10**6 * 64 * 256 - 1, 2**33, 2**40], dtype=np.int64)
    epoch, index = order.locate(stream)
    assert epoch.tolist() == (stream // (2 * 10**8)).tolist()
    assert np.array_equal(index, [order.indices(int(e), np.array([p % (2 * 10**8)]))[0]
                                  for e, p in zip(epoch, stream)])


def test_ranks_split_positions_past_2_31_disjointly_and_completely():
    """At a resume position past 2**31 (1e6 steps x 64 ranks x 256), 4 ranks' micro-batches are disjoint, cover
    the global positions exactly once, and resuming one rank mid-way continues its own stream."""
    order = SampleOrder(2**31 + 11, seed=5)
    start, M, W = 2**34 + 2**31, 8, 4
    per_rank = []
    for r in range(W):
        it = iter(RankBatchSampler(order, rank=r, world_size=W, micro_batch_size=M, start=start))
        per_rank.append([next(it) for _ in range(3)])
    keys = [k for r in range(W) for batch in per_rank[r] for k in batch]
    assert len(set(keys)) == len(keys) == 3 * M * W
    want = set(order.keys(start, 3 * M * W))
    assert set(keys) == want
    resumed = next(iter(RankBatchSampler(order, rank=2, world_size=W, micro_batch_size=M, start=start + M * W)))
    assert resumed == per_rank[2][1]


def test_packer_writes_global_sentence_numbers_past_2_31():
    """The C packer's first sentences (+ the shard's global offset) past 2**31 / 2**40 are exact int64."""
    from pretrain.data.sample_index import _helper

    helper = _helper(False)
    if helper is None:
        pytest.skip("the C helper is not built")
    sizes = np.array([3, 0, 9, 4, 4, 1], np.int32)
    doc = np.array([0, 2, 6], np.int64)
    out = np.zeros(6, np.int64)
    count, last = helper.starts(sizes, doc, 8, out, 2**40 + 2**31)
    first, _ = build_sample_index(sizes, doc, 8)
    assert count == len(first) and np.array_equal(out[:count] - (2**40 + 2**31), first)
    assert last == 2**40 + 2**31 + 6


def test_in_memory_sentence_index_peaks_at_one_copy(monkeypatch):
    """Without a writable cache (a read-only dataset directory) every rank builds the sentence index in RAM:
    8 bytes a sentence, 8 GB per rank at 1e9 sentences. It was filled into a worst-case array and then copied
    (16 GB peak per rank, 128 GB for 8 ranks of a node); the peak must stay one array."""
    from pretrain.data import sample_index
    from pretrain.data.sample_index import load_or_build_sentence_index

    monkeypatch.setattr(sample_index, "_SCAN", 1 << 16)
    n = 4_000_000
    sizes = np.ones(n, np.int32)
    sizes[::1000] = 0

    class Src(SimpleNamespace):  # what the index reads of a ShardedDataset, without a manifest (no cache)
        def __len__(self):
            return n

    src = Src(shards=[SimpleNamespace(sizes=sizes[: n // 2], doc_idx=None),
                      SimpleNamespace(sizes=sizes[n // 2:], doc_idx=None)], starts=np.array([0, n // 2, n], np.int64))
    tracemalloc.start()
    try:
        index = load_or_build_sentence_index(src)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert np.array_equal(index.positions, np.flatnonzero(sizes))
    assert peak < 1.25 * 8 * len(index), f"peak {peak / 1e6:.0f} MB for a {8 * len(index) / 1e6:.0f} MB index"


def test_separators_visit_only_the_shards_of_the_batch():
    """packing "full" looks up document starts per micro-batch: it visited every shard (~600 at 3e10 tokens, a
    few numpy calls each per batch); only the shards holding the batch's samples may be read, with the same
    separators as a pass over all of them."""
    from pretrain.data.sample_index import separators

    rng = np.random.default_rng(11)
    reads = []

    class Shard:
        def __init__(self, k):
            self.k = k
            lens = rng.integers(1, 4, size=int(rng.integers(1, 5)))
            self.sizes = rng.integers(1, 9, size=int(lens.sum())).astype(np.int32)
            self._doc = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            self._off = np.concatenate([[0], np.cumsum(self.sizes)[:-1]]).astype(np.int64)

        @property
        def doc_idx(self):
            reads.append(self.k)
            return self._doc

        @property
        def offsets(self):
            reads.append(self.k)
            return self._off

    shards = [Shard(k) for k in range(500)]
    starts = np.concatenate([[0], np.cumsum([len(s.sizes) for s in shards])]).astype(np.int64)
    src = SimpleNamespace(shards=shards, starts=starts)
    pick = [7, 250, 499]
    first_B = np.array([starts[k] for k in pick] + [starts[250] + 1 if len(shards[250].sizes) > 1 else starts[250]])
    end_B = np.array([starts[k + 1] for k in pick] + [starts[251]])
    rows_K, pos_K = separators(src, first_B, end_B)
    assert set(reads) <= set(pick)
    want = set()
    for b, (f, e) in enumerate(zip(first_B.tolist(), end_B.tolist())):
        k = int(np.searchsorted(starts, f, side="right")) - 1
        s, base = shards[k], int(starts[k])
        want |= {(b, int(s._off[d] - s._off[f - base])) for d in s._doc.tolist() if f - base < d < e - base}
    assert set(zip(rows_K.tolist(), pos_K.tolist())) == want
