"""Samples: packing of sentences, MLM sequence + views, determinism by key, blending by weight."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from pretrain.config.data import AugmentConfig, DataConfig, SourceConfig
from pretrain.data.datasets import (
    BlendedDataset,
    PretrainDataset,
    apportion,
    build_dataset,
)
from pretrain.data.sample_index import build_sample_index


class FakeShards:
    """Stand-in for ShardedDataset: sizes, doc_idx and sentence token arrays."""

    def __init__(self, sentences: list[list[list[int]]]):
        flat = [np.array(s, dtype=np.uint16) for doc in sentences for s in doc]
        self._sents = flat
        self.sizes = np.array([len(s) for s in flat], dtype=np.int32)
        self.doc_idx = np.concatenate([[0], np.cumsum([len(d) for d in sentences])]).astype(np.int64)

    def __len__(self):
        return len(self._sents)

    def __getitem__(self, i):
        return self._sents[i]


def random_docs(rng, num_docs, vocab_lo, vocab_hi, max_sent=12):
    return [
        [rng.integers(vocab_lo, vocab_hi, size=int(rng.integers(0, max_sent))).tolist()
         for _ in range(int(rng.integers(1, 8)))]
        for _ in range(num_docs)
    ]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from pretrain.prep.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("tok")
    text = ("The quick brown fox jumps over the lazy dog. A big car drove fast down the happy road. "
            "She was glad to see the large house and the small garden near the river.\n") * 30
    (d / "corpus.txt").write_text(text)
    return train_tokenizer([str(d / "corpus.txt")], str(d / "tok.json"), vocab_size=200, min_frequency=1)


def reference_packing(sizes, doc_idx, budget):
    """Independent formulation: walk all sentences once, closing a group at doc ends/overflow."""
    groups, cur, used = [], [], 0
    doc_of = np.searchsorted(doc_idx, np.arange(len(sizes)), side="right") - 1
    for i, n in enumerate(sizes.tolist()):
        if cur and (doc_of[i] != doc_of[cur[0]] or (n > 0 and used + n > budget)):
            groups.append(cur)
            cur, used = [], 0
        if n == 0 and not cur:
            continue
        cur.append(i)
        used += n
    if cur:
        groups.append(cur)
    out = []
    for g in groups:
        if sum(sizes[j] for j in g) > 0:
            out.append((g[0], g[-1] + 1))
    return out


@pytest.mark.parametrize("budget", [1, 5, 20])
def test_sample_index_matches_reference_packing(budget):
    docs = random_docs(np.random.default_rng(budget), 40, 6, 50)
    src = FakeShards(docs)
    first, end = build_sample_index(src.sizes, src.doc_idx, budget)
    got = list(zip(first.tolist(), end.tolist()))
    ref = reference_packing(src.sizes, src.doc_idx, budget)
    # The reference keeps trailing empty sentences in the group, so compare on non-empty content.
    strip = lambda ranges: [tuple(i for i in range(a, b) if src.sizes[i]) for a, b in ranges]
    assert strip(got) == strip(ref)
    nonempty = [i for i in range(len(src)) if src.sizes[i]]
    assert sorted(i for g in strip(got) for i in g) == nonempty  # every sentence exactly once
    for a, b in got:
        doc = np.searchsorted(src.doc_idx, a, side="right") - 1
        assert b <= src.doc_idx[doc + 1]  # never crosses a document
        total = src.sizes[a:b].sum()
        assert total <= budget or np.count_nonzero(src.sizes[a:b]) == 1


def test_sample_contents(tokenizer):
    docs = random_docs(np.random.default_rng(0), 30, 6, tokenizer.vocab_size, max_sent=40)
    src = FakeShards(docs)
    cfg = DataConfig(max_len=24, view_max_len=16, augment=AugmentConfig(methods="del-span+reorder"))
    ds = PretrainDataset(src, tokenizer, cfg, seed=5)
    for index in range(len(ds)):
        s = ds[(2, index)]
        text = np.concatenate([src[i] for i in range(*ds.index.range(index))]).astype(np.int64)[:22]
        inp, lab = s["input_ids"], s["mlm_labels"]
        assert inp[0] == tokenizer.cls_id and inp[-1] == tokenizer.sep_id and len(inp) == len(text) + 2 <= 24
        body, lab_body = inp[1:-1], lab[1:-1]
        sel = lab_body != -100
        assert (lab[[0, -1]] == -100).all()
        assert (lab_body[sel] == text[sel]).all() and (body[~sel] == text[~sel]).all()
        for v in ("view_a", "view_b"):
            view = s[v]
            assert view[0] == tokenizer.cls_id and view[-1] == tokenizer.sep_id and len(view) <= 16
            assert s[v].dtype == np.int64
            # Views hold only the text's own tokens plus [DEL] (same multiset minus deleted words).
            body_v = view[1:-1]
            assert set(body_v.tolist()) - {tokenizer.del_id} <= set(text.tolist())


def test_same_key_same_sample_and_noise_varies_with_epoch(tokenizer):
    docs = random_docs(np.random.default_rng(1), 20, 6, tokenizer.vocab_size, max_sent=40)
    cfg = DataConfig(max_len=64, view_max_len=64)
    a = PretrainDataset(FakeShards(docs), tokenizer, cfg, seed=3)
    b = PretrainDataset(FakeShards(docs), tokenizer, cfg, seed=3)
    same = lambda x, y: all(np.array_equal(x[k], y[k]) for k in x)
    assert all(same(a[(1, i)], b[(1, i)]) for i in range(len(a)))
    assert not all(same(a[(0, i)], a[(1, i)]) for i in range(len(a)))
    c = PretrainDataset(FakeShards(docs), tokenizer, cfg, seed=4)
    assert not all(same(a[(0, i)], c[(0, i)]) for i in range(len(a)))
    # Masking does not depend on whether views are built (independent streams).
    nv = PretrainDataset(FakeShards(docs), tokenizer, cfg, seed=3, with_views=False)
    assert "view_a" not in nv[(0, 0)]
    assert all(np.array_equal(nv[(0, i)]["input_ids"], a[(0, i)]["input_ids"]) for i in range(len(a)))


def test_apportion_and_blended_interleave(tokenizer):
    assert apportion(10, [1, 1, 1]).tolist() == [4, 3, 3]
    assert apportion(7, [0.5, 0.25, 0.25]).sum() == 7
    cfg = DataConfig(max_len=16, view_max_len=16)
    rng = np.random.default_rng(2)
    parts = [PretrainDataset(FakeShards(random_docs(rng, n, 6, tokenizer.vocab_size)), tokenizer, cfg, seed=1)
             for n in (30, 10)]
    weights = [0.25, 0.75]
    blend = BlendedDataset(parts, weights, seed=9)
    total = len(parts[0]) + len(parts[1])
    assert len(blend) == total
    counts = apportion(total, weights)
    # Every prefix holds each source in proportion to its weight, within one sample or two.
    source_N = blend.slots(np.arange(total))[0]
    seen = np.zeros(2)
    for i in range(total):
        seen[source_N[i]] += 1
        assert np.abs(seen - (i + 1) * counts / total).max() <= 1.0 + 1e-9
    # Over consecutive epochs a source's positions form consecutive windows covering all its samples.
    for s in (0, 1):
        positions = [blend.locate(e, i)[1] for e in range(4) for i in range(total) if source_N[i] == s]
        start = blend.offset_S[s]
        assert positions == list(range(start, start + 4 * counts[s]))
    sample = blend[(0, 3)]
    s, pos = blend.locate(0, 3)
    assert sample["source"] == s
    assert np.array_equal(sample["input_ids"], parts[s][(0, pos)]["input_ids"])
    # A position past the source's end reuses that text with fresh noise.
    n = len(parts[s])
    again = parts[s][(0, pos + n)]
    assert np.array_equal(np.where(again["mlm_labels"] != -100, again["mlm_labels"], again["input_ids"]),
                          np.where(sample["mlm_labels"] != -100, sample["mlm_labels"], sample["input_ids"]))


class _Sized:
    def __init__(self, n):
        self.n = n

    def __len__(self):
        return self.n


def _merged_order_reference(counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """The blend's order materialised, as the rule states it: slot c of source s at time (c + 0.5) / n_s,
    merged by a stable sort (ties to the lower source), times compared as exact fractions."""
    from fractions import Fraction

    slots = sorted(((Fraction(2 * c + 1, 2 * n), s, c) for s, n in enumerate(counts) for c in range(n)))
    return np.array([s for _, s, _ in slots]), np.array([c for _, _, c in slots])


def test_blend_order_is_computed_exactly_without_materialising_it():
    rng = np.random.default_rng(3)
    cases = [([3, 6, 9], [1, 2, 3]), ([1, 1], [1, 1]), ([5, 5, 5], [1, 1, 1]), ([1, 100], [1, 1]),
             ([4, 8], [1, 1e-3]), ([2000, 700, 5], [3, 1, 1])]
    cases += [(rng.integers(1, 80, s).tolist(), rng.integers(1, 9, s).tolist()) for s in rng.integers(1, 7, 150)]
    for sizes, weights in cases:
        blend = BlendedDataset([_Sized(n) for n in sizes], weights, seed=1)
        want = _merged_order_reference(blend.counts_S.tolist())
        got = blend.slots(np.arange(len(blend)))
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (sizes, weights)
        with pytest.raises(IndexError, match="outside"):
            blend.slots(np.array([len(blend)]))
    # Corpus scale: positions are located one batch at a time, no per-sample array (3:1 of 2e8 samples).
    big = BlendedDataset([_Sized(15 * 10**7), _Sized(5 * 10**7)], [3, 1], seed=1)
    assert not any(isinstance(v, np.ndarray) and v.size > 10 for v in vars(big).values())
    # Slot d of source 1 (time (2d + 1) / 1e8) ties with slot 3d + 1 of source 0 and follows it: position 4d + 2.
    index = np.array([0, 1, 2, 3, 4, 4 * 12345 + 2, 2 * 10**8 - 2, 2 * 10**8 - 1])
    source, slot = big.slots(index)
    assert source.tolist() == [0, 0, 1, 0, 0, 1, 1, 0]
    assert slot.tolist() == [0, 1, 0, 2, 3, 12345, 5 * 10**7 - 1, 15 * 10**7 - 1]


def test_build_dataset_from_preprocessed_shards(tmp_path, tokenizer):
    from pretrain.prep.preprocess import preprocess

    lines = ["The quick brown fox jumps over the lazy dog. A big car drove fast down the road.",
             "", "She was glad to see the large house. The small garden was near the river."]
    (tmp_path / "a.txt").write_text("\n".join(lines * 5) + "\n")
    preprocess([str(tmp_path / "a.txt")], str(tmp_path / "ds"), tokenizer.path, progress=False)
    cfg = DataConfig(tokenizer=tokenizer.path, max_len=32, view_max_len=32,
                     sources=[SourceConfig(name="a", path=str(tmp_path / "ds")),
                              SourceConfig(name="b", path=str(tmp_path / "ds"), weight=3.0)])
    blend = build_dataset(cfg, tokenizer, seed=0)
    assert isinstance(blend, BlendedDataset) and len(blend) == 2 * len(blend.datasets[0]) > 0
    s = blend[(0, 0)]
    assert s["input_ids"][0] == tokenizer.cls_id and "view_b" in s
    with pytest.raises(ValueError, match="data.valid"):
        build_dataset(cfg, tokenizer, seed=0, split="valid")


def test_c_sample_index_equals_python_packing_on_random_corpora():
    """The C helper (built by pip install) against the pure-Python rule, sample for sample."""
    from pretrain.data.sample_index import build_sample_index_py

    _index = pytest.importorskip("pretrain.data._index", reason="C helper not built (pip install -e . builds it)")
    rng = np.random.default_rng(0)
    for trial in range(200):
        lens = rng.integers(0, 40, size=int(rng.integers(0, 300)))
        doc = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        n = int(doc[-1])
        sizes = (rng.integers(0, 60, size=n) * (rng.random(n) > 0.2)).astype(np.int32 if trial % 2 else np.int64)
        budget = int(rng.choice([1, 5, 30, 126, 500]))
        got = build_sample_index(sizes, doc, budget)
        want = build_sample_index_py(sizes, doc, budget)
        assert got[0].dtype == np.int64 and all(np.array_equal(a, b) for a, b in zip(got, want)), (trial, budget)
        # starts (how the cache file is written): the first sentences, shifted by the offset, in place, in one
        # pass into a worst-case buffer, and the last sample's end.
        out = np.full(n + 3, -1, dtype=np.int64)
        count, last = _index.starts(sizes, doc, budget, out[1:n + 2], 1000 + trial)
        assert count == len(want[0]) and np.array_equal(out[1:count + 1], want[0] + 1000 + trial), (trial, budget)
        assert last == (want[1][-1] if count else 0) + 1000 + trial
        assert out[0] == -1 and (out[count + 1:] == -1).all()  # nothing written outside the samples
    with pytest.raises(ValueError, match="doc_idx"):
        _index.pack(np.zeros(3, dtype=np.int64), np.array([0, 5], dtype=np.int64), 4)
    with pytest.raises(ValueError, match="doc_idx"):
        _index.starts(np.zeros(3, dtype=np.int64), np.array([0, 5], dtype=np.int64), 4, np.zeros(3, np.int64), 0)
    sizes, doc = np.array([3, 3, 3, 3], dtype=np.int32), np.array([0, 4], dtype=np.int64)
    assert _index.starts(sizes, doc, 6, np.zeros(2, np.int64), 0) == (2, 4)
    out = np.zeros(4, dtype=np.int64)
    with pytest.raises(ValueError, match="more than the 1 samples"):  # never written past the buffer
        _index.starts(sizes, doc, 6, out[:1], 0)
    with pytest.raises(TypeError, match="read-write bytes-like"):  # a strided view is refused by the parser
        _index.starts(sizes, doc, 6, out[::2], 0)
    with pytest.raises(ValueError, match="contiguous int64"):
        _index.starts(sizes, doc, 6, np.zeros(4, np.int32), 0)


def test_a_batch_is_its_samples_built_one_by_one(tokenizer, tmp_path):
    """``__getitems__`` (what the DataLoader calls) gives, row for row, the samples ``dataset[key]`` builds
    alone: from a preprocessed ShardedDataset (the vectorised token gather) and through a blend."""
    from pretrain.data.collate import collate
    from pretrain.prep.preprocess import preprocess

    text = ("The quick brown fox jumps over the lazy dog. A big car drove fast down the happy road.\n"
            "She was glad to see the large house and the small garden near the river.\n\n") * 40
    (tmp_path / "a.txt").write_text(text)
    preprocess([str(tmp_path / "a.txt")], str(tmp_path / "ds"), tokenizer.path, num_workers=1, progress=False)
    cfg = DataConfig(tokenizer=tokenizer.path, max_len=20, view_max_len=12,
                     sources=[SourceConfig(name="a", path=str(tmp_path / "ds"))],
                     augment=AugmentConfig(methods="del-span+reorder"))
    ds = build_dataset(cfg, tokenizer, seed=2)
    fake = PretrainDataset(FakeShards(random_docs(np.random.default_rng(3), 25, 6, tokenizer.vocab_size)),
                           tokenizer, cfg, seed=2)
    blend = BlendedDataset([ds, fake], [0.5, 0.5], seed=1)
    for dataset in (ds, fake, blend):
        reach = len(dataset) if dataset is blend else 2 * len(dataset)  # a source reuses texts past its end
        keys = [(e, i) for e in (0, 3) for i in range(0, reach, 3)]
        batch = collate(dataset.__getitems__(keys), pad_id=tokenizer.pad_id)
        for b, key in enumerate(keys):
            one = dataset[key]
            for name, field in (("input_ids", "input_ids"), ("mlm_labels", "mlm_labels"),
                                ("view_a", "view_a_ids"), ("view_b", "view_b_ids")):
                n = len(one[name])
                assert batch[field][b, :n].tolist() == one[name].tolist(), (key, name)
                assert (batch[field][b, n:] == (-100 if name == "mlm_labels" else tokenizer.pad_id)).all()
        assert batch["view_a_mask"].sum(1).tolist() == [len(dataset[k]["view_a"]) for k in keys]


@pytest.mark.parametrize("scheme", ["whole_word", "span"])
def test_word_masking_schemes_use_the_tokenizers_word_starts(tokenizer, scheme):
    """Each sample's MLM input equals the row-by-row reference on the tokenizer's own word starts, drawn from the
    sample's key; a batch's rows equal the samples built one by one."""
    import augment_reference as R

    from pretrain.config.data import MaskingConfig
    from pretrain.data.counter_rng import sample_keys

    docs = [[tokenizer.encode("She was glad to see the large house and the small garden near the river."),
             tokenizer.encode("The quick brown fox jumps over the lazy dog.")] for _ in range(6)]
    cfg = DataConfig(max_len=64, view_max_len=32, masking=MaskingConfig(scheme=scheme, prob=0.3))
    ds = PretrainDataset(FakeShards(docs), tokenizer, cfg, seed=2, with_views=False)
    starts = tokenizer.word_start_mask()
    assert not starts.all()  # the tokenizer splits some words into pieces
    reference = R.mask_whole_words if scheme == "whole_word" else R.mask_spans
    batch = ds.__getitems__([(0, i) for i in range(len(ds))])
    for i in range(len(ds)):
        s = ds[(0, i)]
        text = np.concatenate([ds.source[j] for j in range(*ds.index.range(i))]).astype(np.int64)
        seq = np.concatenate([[tokenizer.cls_id], text, [tokenizer.sep_id]])
        key = int(sample_keys(2, 0, [i])[0])
        inp, labels = reference(seq, key, cfg.masking, sorted(tokenizer.special_ids), tokenizer.mask_id,
                                tokenizer.vocab_size, starts)
        assert s["input_ids"].tolist() == inp and s["mlm_labels"].tolist() == labels
        assert np.array_equal(batch.sample(i)["input_ids"], s["input_ids"])
        assert (s["mlm_labels"] != -100).sum() > 0


# ------------------------------------------------------------------------------------------ packing "full"


def reference_full_packing(sizes, doc_idx, budget):
    """Independent formulation of packing "full": the non-empty sentences in order, each tagged with its document;
    a sample takes them while its tokens plus one separator per change of document stay within budget."""
    doc_of = np.searchsorted(doc_idx, np.arange(len(sizes)), side="right") - 1
    groups, cur = [], []
    for i in (i for i in range(len(sizes)) if sizes[i] > 0):
        trial = cur + [i]
        cost = sum(int(sizes[j]) for j in trial) + sum(doc_of[a] != doc_of[b] for a, b in itertools.pairwise(trial))
        if cur and cost > budget:
            groups.append(cur)
            trial = [i]
        cur = trial
    if cur:
        groups.append(cur)
    return groups


@pytest.mark.parametrize("budget", [1, 5, 20, 126])
def test_full_packing_matches_the_reference_in_python_and_c(budget):
    from pretrain.data.sample_index import build_sample_index_py

    rng = np.random.default_rng(budget)
    fewer = 0
    for trial in range(40):
        src = FakeShards(random_docs(rng, int(rng.integers(0, 30)), 6, 50))
        want = reference_full_packing(src.sizes, src.doc_idx, budget)
        for build in (build_sample_index, build_sample_index_py):
            first, end = build(src.sizes, src.doc_idx, budget, True)
            got = [[i for i in range(a, b) if src.sizes[i]] for a, b in zip(first.tolist(), end.tolist())]
            assert got == want, (trial, build.__name__)
            assert all(src.sizes[a] > 0 for a in first.tolist())  # a sample starts with a non-empty sentence
            if len(end):
                assert end[-1] == len(src)  # the last sample runs to the data's end
        within = len(build_sample_index(src.sizes, src.doc_idx, budget)[0])
        assert len(want) <= within
        fewer += len(want) < within
    assert fewer >= (10 if budget >= 5 else 0)  # across documents: fewer samples than packing within them


def test_c_helper_full_starts_equal_python():
    from pretrain.data.sample_index import build_sample_index_py

    _index = pytest.importorskip("pretrain.data._index", reason="C helper not built (pip install -e . builds it)")
    rng = np.random.default_rng(7)
    for trial in range(100):
        src = FakeShards(random_docs(rng, int(rng.integers(1, 40)), 6, 60))
        budget = int(rng.choice([3, 30, 126]))
        first, end = build_sample_index_py(src.sizes, src.doc_idx, budget, True)
        out = np.full(len(src) + 1, -1, dtype=np.int64)
        count, last = _index.starts(src.sizes.astype(np.int64), src.doc_idx, budget, out, 10, True)
        assert count == len(first) and np.array_equal(out[:count], first + 10)
        assert last == (end[-1] if count else 0) + 10


def _full_reference_text(src, first, end, sep_id, budget):
    """The sentences first .. end - 1 concatenated, [SEP] before each non-empty sentence of another document
    than the previous non-empty one."""
    doc_of = np.searchsorted(src.doc_idx, np.arange(len(src)), side="right") - 1
    out, prev = [], None
    for i in range(first, end):
        if not src.sizes[i]:
            continue
        if prev is not None and doc_of[i] != doc_of[prev]:
            out.append(sep_id)
        out.extend(int(t) for t in src[i])
        prev = i
    return out[:budget]


def test_full_packing_samples_hold_their_sentences_with_a_separator_between_documents(tokenizer, tmp_path):
    """From FakeShards (one sample at a time) and from a preprocessed ShardedDataset (the vectorised gather):
    every sample is its sentences with [SEP] between documents, fills max_len - 2 but for the last token budget,
    and the samples cover every token once, in order."""
    from pretrain.data.shards import ShardedDataset
    from pretrain.prep.preprocess import preprocess

    docs = random_docs(np.random.default_rng(11), 60, 6, tokenizer.vocab_size, max_sent=15)
    text = "\n\n".join(" ".join(f"The word{d} number{k} is here." for k in range(int(n)))
                       for d, n in enumerate(np.random.default_rng(2).integers(1, 6, size=50))) + "\n"
    (tmp_path / "a.txt").write_text(text)
    preprocess([str(tmp_path / "a.txt")], str(tmp_path / "ds"), tokenizer.path, shard_size_tokens=300,
               progress=False)
    real = ShardedDataset(str(tmp_path / "ds"))
    assert len(real.shards) > 2
    for source in (FakeShards(docs), real):
        cfg = DataConfig(max_len=24, view_max_len=16, packing="full")
        ds = PretrainDataset(source, tokenizer, cfg, seed=5, with_views=False)
        doc_cfg = DataConfig(max_len=24, view_max_len=16)
        assert len(ds) < len(PretrainDataset(source, tokenizer, doc_cfg, seed=5, with_views=False))
        batch = ds.__getitems__([(0, i) for i in range(len(ds))])
        seen, separators = [], 0
        for i in range(len(ds)):
            s = batch.sample(i)
            first, end = ds.index.range(i)
            want = _full_reference_text(source, first, end, tokenizer.sep_id, 22)
            inp, lab = s["input_ids"][1:-1], s["mlm_labels"][1:-1]
            got = np.where(lab != -100, lab, inp).tolist()
            assert got == want, i
            assert len(s["input_ids"]) <= 24 and s["input_ids"][-1] == tokenizer.sep_id
            separators += got.count(tokenizer.sep_id)
            seen += [t for t in got if t != tokenizer.sep_id]
            shard_starts = np.asarray(getattr(source, "starts", [0])).tolist()
            if i + 1 < len(ds) and ds.index.range(i + 1)[0] not in shard_starts:  # the next sentence did not fit
                nxt = ds.index.range(i + 1)[0]
                last = max(j for j in range(first, end) if source.sizes[j])
                doc_nxt, doc_last = (int(np.searchsorted(source.doc_idx, j, side="right")) - 1 for j in (nxt, last))
                assert len(got) + (doc_nxt != doc_last) + int(source.sizes[nxt]) > 22
        flat = [int(t) for j in range(len(source)) for t in source[j]]
        assert seen == flat and separators > 0
    cfg = DataConfig(max_len=24, view_max_len=16, packing="full")
    from pretrain.data.sample_index import index_cache_path

    assert "-full1-" in index_cache_path(real, 22, "full").name and "-greedy1-" in index_cache_path(real, 22).name
    again = PretrainDataset(ShardedDataset(str(tmp_path / "ds")), tokenizer, cfg, seed=5, with_views=False)
    assert again.index.path == index_cache_path(real, 22, "full") and again.index.path.is_file()
    assert np.array_equal(np.asarray(again.index.starts), np.asarray(ds.index.starts))
