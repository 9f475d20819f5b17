"""IndexedDataset / IndexedDatasetBuilder: round trip, dtypes, atomic publish, corruption detection."""

from __future__ import annotations

import hashlib
import os
import pickle
import struct

import numpy as np
import pytest

from pretrain.data.indexed import (
    HEADER_BYTES,
    IndexedDataset,
    IndexedDatasetBuilder,
    best_dtype,
)


def _random_docs(rng, vocab, n_docs=20):
    return [[rng.integers(0, vocab, size=rng.integers(0, 30)).tolist() for _ in range(rng.integers(1, 6))]
            for _ in range(n_docs)]


def _build(prefix, docs, vocab):
    b = IndexedDatasetBuilder(str(prefix), vocab)
    for doc in docs:
        for seq in doc:
            b.add_item(seq)
        b.end_document()
    return b.finalize()


@pytest.mark.parametrize("vocab,expected", [(1, "uint8"), (256, "uint8"), (257, "uint16"), (65536, "uint16"),
                                            (65537, "int32"), (250_002, "int32")])
def test_best_dtype(vocab, expected):
    assert best_dtype(vocab) == np.dtype(expected)


@pytest.mark.parametrize("vocab", [200, 30522, 100_000])
def test_round_trip(tmp_path, vocab):
    rng = np.random.default_rng(vocab)
    docs = _random_docs(rng, vocab)
    info = _build(tmp_path / "s", docs, vocab)
    ds = IndexedDataset(str(tmp_path / "s"))
    flat = [seq for doc in docs for seq in doc]
    assert len(ds) == len(flat) == info["num_sequences"]
    assert ds.dtype == best_dtype(vocab)
    for i, seq in enumerate(flat):
        np.testing.assert_array_equal(ds[i].astype(np.int64), np.asarray(seq, dtype=np.int64))
    np.testing.assert_array_equal(ds.sizes, [len(s) for s in flat])
    expected_doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in docs])])
    np.testing.assert_array_equal(ds.doc_idx, expected_doc_idx)
    assert info["num_documents"] == len(docs) and info["num_tokens"] == sum(map(len, flat)) == ds.num_tokens
    for ext in ("bin", "idx"):
        with open(tmp_path / f"s.{ext}", "rb") as f:
            data = f.read()
        assert hashlib.sha256(data).hexdigest() == info[f"{ext}_sha256"] and len(data) == info[f"{ext}_bytes"]
    assert os.path.getsize(tmp_path / "s.bin") == ds.num_tokens * ds.dtype.itemsize
    np.testing.assert_array_equal(ds[-1], ds[len(ds) - 1])
    with pytest.raises(IndexError):
        ds[len(ds)]


def test_add_items_equals_add_item(tmp_path):
    rng = np.random.default_rng(0)
    seqs = [rng.integers(0, 500, size=rng.integers(1, 9)) for _ in range(30)]
    a = IndexedDatasetBuilder(str(tmp_path / "a"), 500)
    for s in seqs:
        a.add_item(s)
    b = IndexedDatasetBuilder(str(tmp_path / "b"), 500)
    b.add_items(np.concatenate(seqs), np.array([len(s) for s in seqs]))
    ia, ib = a.finalize(), b.finalize()
    assert ia["bin_sha256"] == ib["bin_sha256"] and ia["idx_sha256"] == ib["idx_sha256"]


def test_add_documents_equals_a_document_at_a_time(tmp_path):
    """Whole documents in one call (dropped ones with no sentences among them, after a document left open by
    add_item) give the files of add_items + end_document per document; bad counts are refused."""
    rng = np.random.default_rng(1)
    counts = np.array([2, 0, 3, 1, 0, 0, 4])
    sizes = rng.integers(1, 6, size=int(counts.sum()))
    flat = rng.integers(0, 300, size=int(sizes.sum()))
    a = IndexedDatasetBuilder(str(tmp_path / "a"), 300)
    a.add_item([7, 8])
    a.end_document()  # add_documents closes the open document first
    s = t = 0
    for n in counts:
        a.add_items(flat[t:t + sizes[s:s + n].sum()], sizes[s:s + n])
        a.end_document()
        s, t = s + n, t + int(sizes[s:s + n].sum())
    b = IndexedDatasetBuilder(str(tmp_path / "b"), 300)
    b.add_item([7, 8])
    b.add_documents(flat, sizes, counts)
    ia, ib = a.finalize(), b.finalize()
    assert ia == ib and ib["num_documents"] == 5
    assert IndexedDataset(str(tmp_path / "b")).doc_idx.tolist() == [0, 1, 3, 6, 7, 11]
    c = IndexedDatasetBuilder(str(tmp_path / "c"), 300)
    with pytest.raises(ValueError, match="sum to 9"):
        c.add_documents(flat, sizes, counts - np.array([1, 0, 0, 0, 0, 0, 0]))
    with pytest.raises(ValueError, match=">= 0"):
        c.add_documents(flat, sizes, np.array([11, -1]))
    c.abort()


def test_empty_documents_ignored_and_empty_shard(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "e"), 10)
    b.end_document()
    b.add_item([1, 2])
    b.end_document()
    b.end_document()
    assert b.finalize()["num_documents"] == 1
    assert IndexedDataset(str(tmp_path / "e")).doc_idx.tolist() == [0, 1]
    IndexedDatasetBuilder(str(tmp_path / "z"), 10).finalize()
    z = IndexedDataset(str(tmp_path / "z"))
    assert len(z) == 0 and z.num_documents == 0


def test_publish_is_atomic_and_abort_cleans(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "p"), 100)
    b.add_item([1, 2, 3])
    assert not (tmp_path / "p.bin").exists() and not (tmp_path / "p.idx").exists()
    with pytest.raises(FileNotFoundError):
        IndexedDataset(str(tmp_path / "p"))
    b.abort()
    assert os.listdir(tmp_path) == []


def test_out_of_range_ids_rejected(tmp_path):
    b = IndexedDatasetBuilder(str(tmp_path / "r"), 100)
    with pytest.raises(ValueError, match="out of range"):
        b.add_item([5, 100])
    with pytest.raises(ValueError, match="out of range"):
        b.add_item([-1])
    b.abort()


def test_pickle_reopens_by_prefix(tmp_path):
    _build(tmp_path / "k", _random_docs(np.random.default_rng(1), 1000, n_docs=200), 1000)
    ds = IndexedDataset(str(tmp_path / "k"))
    blob = pickle.dumps(ds)
    assert len(blob) < 300
    again = pickle.loads(blob)
    for i in range(len(ds)):
        np.testing.assert_array_equal(again[i], ds[i])


@pytest.fixture
def shard(tmp_path):
    _build(tmp_path / "c", _random_docs(np.random.default_rng(2), 1000), 1000)
    return tmp_path / "c"


def _damage(path, fn):
    data = bytearray(open(path, "rb").read())
    data = fn(data)
    open(path, "wb").write(bytes(data))


@pytest.mark.parametrize("what,match", [
    ("truncate_bin", r"c\.bin is truncated"),
    ("truncate_idx", r"c\.idx is truncated"),
    ("magic", "bad magic"),
    ("version", "format version"),
    ("dtype", "dtype code"),
    ("sizes", "do not tile"),
    ("doc_idx", "document boundaries"),
])
def test_corruption_detected(shard, what, match):
    idx, binf = f"{shard}.idx", f"{shard}.bin"
    n = IndexedDataset(str(shard)).sizes.size
    if what == "truncate_bin":
        _damage(binf, lambda d: d[:-2])
    elif what == "truncate_idx":
        _damage(idx, lambda d: d[:-4])
    elif what == "magic":
        _damage(idx, lambda d: b"XXXXXXXX" + d[8:])
    elif what == "version":
        _damage(idx, lambda d: d[:8] + struct.pack("<I", 99) + d[12:])
    elif what == "dtype":
        _damage(idx, lambda d: d[:12] + struct.pack("<I", 3) + d[16:])
    elif what == "sizes":  # last sizes entry +1 (sizes are the last 4*N bytes)
        def bump(d):
            v = struct.unpack_from("<i", d, len(d) - 4)[0]
            struct.pack_into("<i", d, len(d) - 4, v + 1)
            return d
        _damage(idx, bump)
    elif what == "doc_idx":  # first doc boundary after 0 set to 0 (empty document)
        _damage(idx, lambda d: (struct.pack_into("<q", d, HEADER_BYTES + 8 * n + 8, 0), d)[1])
    with pytest.raises(ValueError, match=match):
        IndexedDataset(str(shard))


@pytest.mark.parametrize("slice_", [1, 7, 1 << 18])
def test_index_written_in_slices_is_the_format_byte_for_byte(tmp_path, monkeypatch, slice_):
    """finalize writes and hashes the .idx slice by slice (bounded memory); the bytes are FORMAT.md's layout
    (header, offsets, doc_idx, sizes) as built in one piece, whatever the slice size."""
    from pretrain.data import indexed

    monkeypatch.setattr(indexed, "_SLICE", slice_)
    rng = np.random.default_rng(slice_)
    b = IndexedDatasetBuilder(str(tmp_path / "s"), 30000)
    sizes, docs = [], [0]
    for _ in range(40):
        for _ in range(int(rng.integers(0, 9))):
            n = int(rng.integers(0, 40))
            b.add_item(rng.integers(0, 30000, n))
            sizes.append(n)
        b.end_document()
        if len(sizes) > docs[-1]:
            docs.append(len(sizes))
    info = b.finalize()
    sizes_a = np.array(sizes, dtype="<i4")
    offsets = np.concatenate([[0], np.cumsum(sizes_a, dtype=np.int64)[:-1]]).astype("<i8")
    want = (struct.pack("<8sIIQQQ", b"PTIDX\x00\x00\x00", 1, indexed._CODE_OF[np.dtype(np.uint16)], len(sizes),
                        len(docs) - 1, int(sizes_a.sum()))
            + offsets.tobytes() + np.array(docs, dtype="<i8").tobytes() + sizes_a.tobytes())
    raw = (tmp_path / "s.idx").read_bytes()
    assert raw == want
    assert info["idx_bytes"] == len(raw) and info["idx_sha256"] == hashlib.sha256(raw).hexdigest()
