"""CLEAR augmentations: every row of random batches equals the row-by-row Python reference on the same
draws, rates and uniformity over keys, reorder as a permutation of whole words, [DEL] merging, WordNet
substitution, config errors. Rates are checked within ``Z`` standard deviations computed for each count."""

from __future__ import annotations

import pickle
import zlib
from itertools import combinations
from pathlib import Path

import augment_reference as R
import numpy as np
import pytest

from pretrain.config.data import AugmentConfig
from pretrain.data import augment as A
from pretrain.data.counter_rng import sample_keys
from pretrain.data.ragged import Ragged
from pretrain.data.wordnet import load_synonyms, read_synonyms

DEL = 5
VOCAB = 100
# ids 0..5 specials, 6..59 word starts, 60..99 continuation pieces ("##x").
WS = np.arange(VOCAB) < 60
FIXED = (0, 2, 3, 4)
"""[PAD], [CLS], [SEP], [MASK]: inside a text (packing=full's [SEP] before a document) they stay in place; [UNK] (1)
is a word like any other."""
Z = 5.0
"""Standard deviations a measured rate may be from its expectation (two-sided tail ~6e-7 per check)."""


def binomial_bound(p: float, n: int) -> float:
    """Z standard deviations of the fraction of successes in n Bernoulli(p) trials."""
    return Z * np.sqrt(p * (1 - p) / n)


def make_words(rng: np.random.Generator, num_words: int) -> list[list[int]]:
    """Words of 1-3 tokens: a start piece plus continuation pieces."""
    words = []
    for _ in range(num_words):
        n = int(rng.integers(1, 4))
        words.append([int(rng.integers(6, 60))] + rng.integers(60, VOCAB, size=n - 1).tolist())
    return words


def flat(words: list[list[int]]) -> np.ndarray:
    return np.array([t for w in words for t in w], dtype=np.int64)


def batch_of(rows: list[list[int]]) -> Ragged:
    return Ragged.from_rows([np.array(r, dtype=np.int64) for r in rows])


def random_rows(rng: np.random.Generator, n: int) -> list[list[int]]:
    """Rows of 0-60 words (empty and one-word rows included), some with [DEL] words already in them, some with
    [SEP] / [CLS] / [UNK] tokens inside (a [SEP] may be followed by a continuation piece)."""
    rows = []
    for _ in range(n):
        words = make_words(rng, int(rng.choice([0, 1, 2, 3, 7, 20, 40, 60])))
        specials = rng.random() < 0.3
        for w in range(len(words)):
            u = rng.random()
            if u < 0.05:
                words[w] = [DEL]
            elif specials and u < 0.15:
                words[w] = [int(rng.choice([1, 2, 3]))] + words[w][1:]
        rows.append(flat(words).tolist())
    return rows


SYNONYMS = {(w,): [np.array([w + 1]), np.array([59, 99])] for w in range(6, 59, 3)}
SYNONYMS.update({(7, 60): [np.array([58])], (8, 61, 62): [np.array([57, 98]), np.array([6])]})
COMBINATIONS = ["del-word", "del-span", "reorder", "subs", "none", "del-span+reorder", "subs+del-span",
                "reorder+del-word", "del-word+subs"]


@pytest.mark.parametrize("methods", COMBINATIONS)
@pytest.mark.parametrize("with_del", [True, False])
def test_batched_views_equal_the_row_by_row_reference(methods, with_del):
    """Every row of every batch equals the plain-Python restatement of the rules on the same draws."""
    cfg = AugmentConfig(methods=methods)
    table = A.SynonymTable.from_mapping(SYNONYMS, VOCAB)
    aug = A.Augmenter(cfg, A.parse_methods(methods), WS, DEL if with_del else None, table, fixed_ids=FIXED)
    ws_ref = np.append(WS, True)
    ws_ref[DEL] = True
    del_ref = DEL if with_del else VOCAB
    rng = np.random.default_rng([zlib.crc32(methods.encode()), with_del])
    for trial in range(25):
        rows = random_rows(rng, int(rng.integers(1, 12))) if trial else [[], []]  # all rows empty, too
        keys = sample_keys(trial, 0, np.arange(len(rows)))
        got = aug(batch_of(rows), keys).rows()
        for row, key, out in zip(rows, keys.tolist(), got):
            expected = R.augment(row, key, A.parse_methods(methods), cfg, ws_ref, del_ref, SYNONYMS,
                                 drop_deleted=not with_del, fixed=set(FIXED))
            assert out.tolist() == expected, (methods, row)


def test_a_row_does_not_depend_on_its_batch():
    cfg = AugmentConfig(methods="del-span+reorder")
    aug = A.Augmenter(cfg, A.parse_methods(cfg.methods), WS, DEL)
    rows = random_rows(np.random.default_rng(1), 9)
    keys = sample_keys(3, 1, np.arange(9))
    together = aug(batch_of(rows), keys).rows()
    for b in range(9):
        alone = aug(batch_of([rows[b]]), keys[b:b + 1]).rows()[0]
        assert alone.tolist() == together[b].tolist()


def test_del_word_rate_and_uniformity_over_keys():
    words = make_words(np.random.default_rng(0), 30)
    for i, w in enumerate(words):
        w[0] = 6 + i  # distinct word starts make the deleted set recoverable
    aug = A.Augmenter(AugmentConfig(methods="del-word"), ("del-word",), WS, DEL)
    out = aug(batch_of([flat(words).tolist()] * 600), sample_keys(0, 0, np.arange(600))).rows()
    hits = np.zeros(30)
    for row in out:
        kept = [t for t in row.tolist() if t != DEL and t < 60]
        assert len(kept) == 30 - 21  # exactly round(0.7 * 30) words deleted
        deleted = np.ones(30, bool)
        deleted[np.array(kept) - 6] = False
        hits += deleted
    assert np.abs(hits / 600 - 0.7).max() < binomial_bound(0.7, 600)  # each word: 21 of 30 drawn uniformly


def test_the_two_views_of_a_sample_are_drawn_independently():
    """View a and view b of a sample delete independent sets: their overlap is hypergeometric (21 of 30 words
    each: mean 21 * 21 / 30, variance 21 * 0.7 * 0.3 * 9 / 29), and a view's set is a function of its key."""
    from pretrain.data.counter_rng import derive

    words = [[6 + i] for i in range(30)]
    aug = A.Augmenter(AugmentConfig(methods="del-word"), ("del-word",), WS, DEL)
    n = 2000
    keys = sample_keys(4, 0, np.arange(n))
    rows = batch_of([flat(words).tolist()] * (2 * n))
    both = aug(rows, np.concatenate([derive(keys, 1), derive(keys, 2)])).rows()
    dead = np.zeros((2 * n, 30), bool)
    for i, row in enumerate(both):
        dead[i] = True
        kept = [t - 6 for t in row.tolist() if t != DEL]
        dead[i, kept] = False
    assert (dead.sum(axis=1) == 21).all()
    overlap = (dead[:n] & dead[n:]).sum(axis=1)
    mean, var = 21 * 21 / 30, 21 * 0.7 * 0.3 * 9 / 29
    assert abs(overlap.mean() - mean) < Z * np.sqrt(var / n)
    assert not (dead[:n] == dead[n:]).all(axis=1).any()  # equal sets: 1 in C(30, 21) ~ 7e-8 a pair
    again = aug(batch_of([flat(words).tolist()] * 3), derive(keys[:3], 1)).rows()
    assert [r.tolist() for r in again] == [r.tolist() for r in both[:3]]


def test_span_placements_are_uniform_and_spans_do_not_overlap():
    n = 3000
    starts_BK, ok_BK = A.place_spans(sample_keys(5, 0, np.arange(n)), 0, np.full(n, 7), np.full(n, 2),
                                     np.full(n, 2))
    assert ok_BK.all()
    placements = {}
    for s in map(tuple, starts_BK.tolist()):
        placements[s] = placements.get(s, 0) + 1
    expected = {c for c in combinations(range(6), 2) if c[1] - c[0] >= 2}
    assert set(placements) == expected
    freq = np.array(list(placements.values())) / n
    assert np.abs(freq - 1 / len(expected)).max() < binomial_bound(1 / len(expected), n)


@pytest.mark.parametrize("num_words", [2, 5, 20, 60, 101])
def test_reorder_swaps_whole_spans_pairwise(num_words):
    words = make_words(np.random.default_rng(100 + num_words), num_words)
    for i, w in enumerate(words):
        w[0] = 6 + i % 54
    ids = flat(words)
    cfg = AugmentConfig(methods="reorder")
    aug = A.Augmenter(cfg, ("reorder",), WS, DEL)
    span_len = max(1, R.rhu(0.05 * num_words))
    k = min(5, max(1, R.rhu(5 * 0.05 * num_words / span_len)), num_words // (2 * span_len))
    for out in aug(batch_of([ids.tolist()] * 20), sample_keys(1, 0, np.arange(20))).rows():
        assert sorted(out.tolist()) == sorted(ids.tolist())  # multiset preserved
        moved = [w for w in R.split_words(out.tolist(), WS)]
        assert len(moved) == num_words
        assert sum(a != b for a, b in zip(moved, words)) <= 2 * k * span_len
        if num_words == 101:  # the paper's setting on a long text: 5 pairs of 5% spans
            assert (span_len, k) == (5, 5)


def test_merge_deletions_and_no_consecutive_del_after_any_method():
    r = A.merge_deletions(batch_of([[DEL, DEL, 7, DEL, DEL, DEL, 8, DEL], [DEL], []]), DEL)
    assert [x.tolist() for x in r.rows()] == [[DEL, 7, DEL, 8, DEL], [DEL], []]
    words = make_words(np.random.default_rng(3), 25)
    words[4] = [DEL]
    words[5] = [DEL]
    for methods in ("del-word", "del-span", "del-span+reorder", "reorder+del-word"):
        aug = A.Augmenter(AugmentConfig(), A.parse_methods(methods), WS, DEL)
        for out in aug(batch_of([flat(words).tolist()] * 20), sample_keys(0, 0, np.arange(20))).rows():
            assert not ((out[1:] == DEL) & (out[:-1] == DEL)).any(), methods


def test_substitution_counts_and_only_uses_synonyms():
    """Single-token words and synonyms: position w of the view is word w or one of its synonyms, and exactly
    min(candidates, round(0.3 W)) words change (a synonym never equals its word here)."""
    mapping = {(w,): [np.array([w + 20]), np.array([w + 21])] for w in range(6, 30, 2)}
    row = list(range(6, 26))  # 20 one-token words, 10 of them with synonyms
    aug = A.Augmenter(AugmentConfig(methods="subs"), ("subs",), WS, DEL, A.SynonymTable.from_mapping(mapping, VOCAB))
    hits = np.zeros(20)
    for out in aug(batch_of([row] * 400), sample_keys(2, 0, np.arange(400))).rows():
        assert len(out) == 20
        changed = out != np.array(row)
        assert changed.sum() == min(10, R.rhu(0.3 * 20))
        for w in np.flatnonzero(changed).tolist():
            assert out[w] in (row[w] + 20, row[w] + 21)
        hits += changed
    assert hits[1::2].sum() == 0  # words without synonyms never change
    assert np.abs(hits[0::2] / 400 - 0.6).max() < binomial_bound(0.6, 400)  # 6 of the 10 candidates, uniformly


def test_wordnet_reader_parses_synsets(tmp_path):
    lines = [
        "  1 This software and database is being provided\n",
        "00001740 03 n 03 entity 0 thing 0 Lion_King 0 000 | gloss\n",
        "00003356 00 a 02 big(a) 0 large 1 000 | gloss\n",
    ]
    (tmp_path / "data.noun").write_text("".join(lines[:2]))
    (tmp_path / "data.adj").write_text(lines[2])
    for name in ("data.verb", "data.adv"):
        (tmp_path / name).write_text("")
    syn = read_synonyms(tmp_path)
    assert syn == {"entity": ("thing",), "thing": ("entity",), "big": ("large",), "large": ("big",)}


def test_missing_wordnet_is_a_clear_error(tmp_path):
    cfg = AugmentConfig(methods="subs+del-span", wordnet_dir=str(tmp_path / "nowhere"))
    with pytest.raises(FileNotFoundError, match="apt-get install wordnet-base"):
        A.build_augmenter(cfg, tokenizer=None)


def test_unknown_method_and_bad_rate():
    with pytest.raises(ValueError, match="del-spam"):
        A.parse_methods("del-spam+reorder")
    with pytest.raises(ValueError, match="data.augment.del_word_rate"):
        AugmentConfig(del_word_rate=1.5)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from pretrain.prep.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("tok")
    text = ("The quick brown fox jumps over the lazy dog. A big car drove fast down the happy road. "
            "She was glad to see the large house and the small garden near the river. ") * 30
    (d / "corpus.txt").write_text(text)
    return train_tokenizer([str(d / "corpus.txt")], str(d / "tok.json"), vocab_size=200, min_frequency=1)


@pytest.mark.skipif(not Path("/usr/share/wordnet/data.noun").is_file(), reason="wordnet-base not installed")
def test_real_wordnet_substitution_uses_synonyms(tokenizer):
    """The WordNet table (single-token words, tabulated once) and multi-token words (looked up) both give
    real synonyms; the augmenter survives pickling (DataLoader workers) with the same output."""
    aug = A.build_augmenter(AugmentConfig(methods="subs"), tokenizer)
    syn = load_synonyms("/usr/share/wordnet")  # the cache the augmenter uses too
    text = "the big car drove fast down the happy road"
    ids = np.array(tokenizer.encode(text))
    keys = sample_keys(0, 0, np.arange(10))
    out_rows = aug(batch_of([ids.tolist()] * 10), keys).rows()
    changed = 0
    for row in out_rows:
        out = tokenizer.decode(row).split()
        assert len(out) == len(text.split())  # one-word synonyms only
        for a, b in zip(text.split(), out):
            if a != b:
                assert b in syn[a], (a, b)
                changed += 1
    assert changed > 0
    again = pickle.loads(pickle.dumps(aug))
    assert [r.tolist() for r in again(batch_of([ids.tolist()] * 10), keys).rows()] == [r.tolist() for r in out_rows]


@pytest.mark.parametrize("methods", ["del-word", "del-span", "del-span+reorder", "reorder+del-word",
                                     "del-word+del-span"])
@pytest.mark.parametrize("with_del", [True, False])
def test_a_deletion_never_leaves_a_view_without_a_word(methods, with_del):
    """A one-word text (one or several pieces) keeps its word in every view (it was [DEL] alone, the same for
    every such sample, or nothing at all without [DEL]); longer texts keep at least one word, even at rate 1."""
    for cfg in (AugmentConfig(methods=methods), AugmentConfig(methods=methods, del_word_rate=1.0, del_span_frac=0.5)):
        aug = A.Augmenter(cfg, A.parse_methods(methods), WS, DEL if with_del else None)
        n = 200
        for row in ([7], [7, 60, 61], [1]):
            for out in aug(batch_of([row] * n), sample_keys(0, 0, np.arange(n))).rows():
                assert out.tolist() == row, (methods, row)
        rng = np.random.default_rng(6)
        rows = [flat(make_words(rng, int(rng.integers(2, 6)))).tolist() for _ in range(n)]
        for row, out in zip(rows, aug(batch_of(rows), sample_keys(1, 0, np.arange(n))).rows()):
            assert set(out.tolist()) - {DEL}, (methods, row, out)


def test_vocabulary_without_del_drops_deleted_words():
    """An imported HF BERT vocabulary has no [DEL]: the same draws delete the words without a marker."""
    words = make_words(np.random.default_rng(5), 30)
    cfg = AugmentConfig(methods="del-span")
    with_del = A.Augmenter(cfg, A.parse_methods(cfg.methods), WS, DEL)
    without = A.Augmenter(cfg, A.parse_methods(cfg.methods), WS, None)
    keys = sample_keys(0, 0, np.arange(1))
    marked = with_del(batch_of([flat(words).tolist()]), keys).rows()[0]
    dropped = without(batch_of([flat(words).tolist()]), keys).rows()[0]
    assert DEL in marked.tolist()
    assert dropped.tolist() == [t for t in marked.tolist() if t != DEL]
    assert dropped.max() < VOCAB


def test_counter_draws_are_uniform_independent_and_width_free():
    from pretrain.data.counter_rng import derive, draw_keys, draws

    keys = sample_keys(0, 0, np.arange(2000))
    u = draws(keys, 3, 64)
    assert np.array_equal(u[:, :10], draws(keys, 3, 10))  # column j does not depend on the width asked for
    # Var(U) = 1/12; Var((U - 1/2)^2) = 1/80 - 1/144 = 1/180.
    assert abs(u.mean() - 0.5) < Z * np.sqrt(1 / 12 / u.size) and abs(u.var() - 1 / 12) < Z * np.sqrt(1 / 180 / u.size)
    counts = np.histogram(u, bins=20, range=(0, 1))[0]
    chi2 = ((counts - u.size / 20) ** 2 / (u.size / 20)).sum()
    assert chi2 < 45  # 19 degrees of freedom: p < 1e-3 above ~43.8
    # Neighbouring columns, streams, samples, epochs, seeds and derived keys are uncorrelated.
    others = [draws(keys, 4, 64), draws(sample_keys(0, 1, np.arange(2000)), 3, 64),
              draws(sample_keys(1, 0, np.arange(2000)), 3, 64), draws(derive(keys, 1), 3, 64),
              draws(sample_keys(0, 0, np.arange(1, 2001)), 3, 64)]
    for other in others + [u[:, 1:]]:
        a = u[:, : other.shape[1]].ravel()
        assert abs(np.corrcoef(a, other.ravel())[0, 1]) < Z / np.sqrt(a.size)  # sd of r: 1 / sqrt(n)
    k = draw_keys(keys, 3, 300)
    assert all(len(set(row)) == 300 for row in k.tolist())  # distinct within a row
    assert len(set(keys.tolist())) == 2000


@pytest.mark.parametrize("methods", ["del-word", "del-span", "reorder", "del-span+reorder"])
def test_separators_inside_the_text_stay_in_place(tokenizer, methods):
    """packing=full puts a [SEP] before each document that starts inside a sample: the views built by
    build_augmenter keep every such [SEP], at its place among the words (deletions and swaps act on the other
    words), never turned into [DEL] nor moved."""
    docs = ["The quick brown fox jumps over the lazy dog near the river", "A big car drove fast down the road",
            "She was glad to see the large house and the small garden"]
    sep = tokenizer.sep_id
    ids = [t for i, d in enumerate(docs) for t in ([sep] if i else []) + tokenizer.encode(d)]
    ws = tokenizer.word_start_mask()
    words_in = R.split_words(ids, ws, {sep})
    at = [q for q, w in enumerate(words_in) if w == [sep]]
    segments_in = [[w for w in words_in[a + 1:b]] for a, b in zip([-1] + at, at + [len(words_in)])]
    aug = A.build_augmenter(AugmentConfig(methods=methods, del_span_frac=0.2), tokenizer)
    for out in aug(batch_of([ids] * 100), sample_keys(0, 0, np.arange(100))).rows():
        words_out = R.split_words(out.tolist(), ws, {sep})
        assert out.tolist().count(sep) == len(at)
        if methods == "reorder":  # each [SEP] at its word index; the words are the same words
            assert [q for q, w in enumerate(words_out) if w == [sep]] == at
            assert sorted(map(tuple, words_out)) == sorted(map(tuple, words_in))
        elif "reorder" not in methods:  # each document keeps its own words, in order, minus the deleted ones
            cut = [q for q, w in enumerate(words_out) if w == [sep]]
            segments_out = [words_out[a + 1:b] for a, b in zip([-1] + cut, cut + [len(words_out)])]
            for seg_in, seg_out in zip(segments_in, segments_out):
                kept = iter(seg_in)
                assert all(any(w == v for v in kept) for w in seg_out if w != [tokenizer.del_id])
