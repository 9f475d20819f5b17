"""CLEAR augmentations: exact outputs for fixed generators (replayed by hand), rates over seeds,
reorder as a permutation of whole words, [DEL] merging, WordNet substitution, config errors."""

from __future__ import annotations

import pickle
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest

from pretrain.config.data import AugmentConfig
from pretrain.data import augment as A
from pretrain.data.wordnet import load_synonyms, read_synonyms

DEL = 5
VOCAB = 100
# ids 0..5 specials, 6..59 word starts, 60..99 continuation pieces ("##x").
WS = np.arange(VOCAB) < 60


def make_words(rng: np.random.Generator, num_words: int) -> list[list[int]]:
    """Words of 1-3 tokens: a start piece plus continuation pieces."""
    words = []
    for _ in range(num_words):
        n = int(rng.integers(1, 4))
        words.append([int(rng.integers(6, 60))] + rng.integers(60, VOCAB, size=n - 1).tolist())
    return words


def flat(words: list[list[int]]) -> np.ndarray:
    return np.array([t for w in words for t in w], dtype=np.int64)


def build_with_dels(words: list[list[int]], deleted: set[int]) -> list[int]:
    """Direct reference: deleted words -> one [DEL]; a [DEL] never follows a [DEL]."""
    out: list[int] = []
    for w, toks in enumerate(words):
        if w in deleted or toks == [DEL]:
            if not out or out[-1] != DEL:
                out.append(DEL)
        else:
            out.extend(toks)
    return out


def rhu(x: float) -> int:
    return int(np.floor(x + 0.5))


@pytest.mark.parametrize("num_words", [1, 7, 40])
def test_del_word_matches_direct_computation(num_words):
    words = make_words(np.random.default_rng(num_words), num_words)
    for seed in range(5):
        out = A.delete_words(flat(words), np.random.default_rng(seed), word_start_V=WS, del_id=DEL, rate=0.7)
        chosen = np.random.default_rng(seed).choice(num_words, size=rhu(0.7 * num_words), replace=False)
        assert out.tolist() == build_with_dels(words, set(chosen.tolist()))


def test_del_word_rate_and_uniformity_over_seeds():
    words = make_words(np.random.default_rng(0), 30)
    for i, w in enumerate(words):
        w[0] = 6 + i  # distinct word starts make the deleted set recoverable
    ids = flat(words)
    hits = np.zeros(30)
    for seed in range(600):
        out = A.delete_words(ids, np.random.default_rng(seed), word_start_V=WS, del_id=DEL, rate=0.7)
        # Word starts that survive, in order: exactly 30 - 21 of the original words.
        kept = [t for t in out.tolist() if t != DEL and t < 60]
        assert len(kept) == 30 - 21
        # Recover which words were deleted: each surviving start matches the next original word.
        w, deleted = 0, np.ones(30, bool)
        for t in kept:
            while words[w][0] != t:
                w += 1
            deleted[w] = False
            w += 1
        hits += deleted
    assert np.abs(hits / 600 - 0.7).max() < 0.08


@pytest.mark.parametrize("num_words", [3, 12, 40, 101])
def test_del_span_matches_direct_computation(num_words):
    words = make_words(np.random.default_rng(num_words), num_words)
    for seed in range(5):
        out = A.delete_spans(flat(words), np.random.default_rng(seed), word_start_V=WS, del_id=DEL, num_spans=5,
                             frac=0.05)
        span_len = max(1, rhu(0.05 * num_words))
        k = min(5, max(1, rhu(5 * 0.05 * num_words / span_len)), num_words // span_len)
        slots = np.sort(np.random.default_rng(seed).choice(num_words - k * span_len + k, size=k, replace=False))
        deleted = {int(s) + i * (span_len - 1) + j for i, s in enumerate(slots) for j in range(span_len)}
        assert len(deleted) == k * span_len  # non-overlapping
        assert out.tolist() == build_with_dels(words, deleted)
        if num_words == 101:  # the paper's setting on a long text: 5 spans of 5% each
            assert (span_len, k) == (5, 5)


def test_place_spans_is_uniform_over_non_overlapping_placements():
    placements = {}
    for seed in range(3000):
        starts = tuple(A.place_spans(np.random.default_rng(seed), 7, 2, 2).tolist())
        placements[starts] = placements.get(starts, 0) + 1
    expected = {c for c in combinations(range(6), 2) if c[1] - c[0] >= 2}
    assert set(placements) == expected
    freq = np.array(list(placements.values())) / 3000
    assert np.abs(freq - 1 / len(expected)).max() < 0.03


@pytest.mark.parametrize("num_words", [2, 5, 20, 60])
def test_reorder_swaps_whole_spans_pairwise(num_words):
    words = make_words(np.random.default_rng(100 + num_words), num_words)
    ids = flat(words)
    for seed in range(5):
        out = A.reorder_spans(ids, np.random.default_rng(seed), word_start_V=WS, num_pairs=5, frac=0.05)
        assert sorted(out.tolist()) == sorted(ids.tolist())  # multiset preserved
        span_len = max(1, rhu(0.05 * num_words))
        k = min(5, max(1, rhu(5 * 0.05 * num_words / span_len)), num_words // (2 * span_len))
        rng = np.random.default_rng(seed)
        slots = np.sort(rng.choice(num_words - 2 * k * span_len + 2 * k, size=2 * k, replace=False))
        starts = [int(s) + i * (span_len - 1) for i, s in enumerate(slots)]
        perm = rng.permutation(2 * k)
        order = list(range(num_words))
        for p in range(k):
            a, b = starts[perm[2 * p]], starts[perm[2 * p + 1]]
            order[a : a + span_len], order[b : b + span_len] = order[b : b + span_len], order[a : a + span_len]
        assert out.tolist() == [t for w in order for t in words[w]]
        moved = sum(o != i for i, o in enumerate(order))
        assert moved == 2 * k * span_len


def test_merge_deletions_and_no_consecutive_del_after_any_method():
    assert A.merge_deletions(np.array([DEL, DEL, 7, DEL, DEL, DEL, 8, DEL]), DEL).tolist() == [DEL, 7, DEL, 8, DEL]
    words = make_words(np.random.default_rng(3), 25)
    words[4] = [DEL]
    words[5] = [DEL]
    cfg = AugmentConfig()
    for methods in ("del-word", "del-span", "del-span+reorder", "reorder+del-word"):
        aug = A.Augmenter(cfg, A.parse_methods(methods), WS, DEL, tokenizer=None)
        for seed in range(20):
            out = aug(flat(words), np.random.default_rng(seed))
            assert not ((out[1:] == DEL) & (out[:-1] == DEL)).any(), methods


def test_substitution_with_a_lookup_matches_direct_computation():
    words = make_words(np.random.default_rng(9), 20)
    table = {tuple(words[w]): (np.array([59, 99]), np.array([58])) for w in range(0, 20, 3)}

    def lookup(word):
        return table.get(word, ())

    for seed in range(5):
        out = A.substitute_synonyms(flat(words), np.random.default_rng(seed), word_start_V=WS, rate=0.3,
                                    lookup=lookup)
        rng = np.random.default_rng(seed)
        cands = np.array([w for w in range(20) if tuple(words[w]) in table])
        k = min(len(cands), rhu(0.3 * 20))
        expected = [list(w) for w in words]
        for w in np.sort(rng.choice(cands, size=k, replace=False)).tolist():
            opts = table[tuple(words[w])]
            expected[w] = opts[int(rng.integers(len(opts)))].tolist()
        assert out.tolist() == [t for w in expected for t in w]
        assert sum(a != b for a, b in zip(expected, words)) == k


def test_combination_applies_methods_in_order_with_one_stream():
    words = make_words(np.random.default_rng(4), 30)
    cfg = AugmentConfig(methods="del-span+reorder")
    aug = A.Augmenter(cfg, A.parse_methods(cfg.methods), WS, DEL, tokenizer=None)
    rng = np.random.default_rng(11)
    step1 = A.delete_spans(flat(words), rng, word_start_V=aug.word_start_V, del_id=DEL, num_spans=5, frac=0.05)
    step2 = A.reorder_spans(step1, rng, word_start_V=aug.word_start_V, num_pairs=5, frac=0.05)
    assert aug(flat(words), np.random.default_rng(11)).tolist() == A.merge_deletions(step2, DEL).tolist()


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
    from pretrain.data.tokenizer import train_tokenizer

    d = tmp_path_factory.mktemp("tok")
    text = ("The quick brown fox jumps over the lazy dog. A big car drove fast down the happy road. "
            "She was glad to see the large house and the small garden near the river. ") * 30
    (d / "corpus.txt").write_text(text)
    return train_tokenizer([str(d / "corpus.txt")], str(d / "tok.json"), vocab_size=200, min_frequency=1)


@pytest.mark.skipif(not Path("/usr/share/wordnet/data.noun").is_file(), reason="wordnet-base not installed")
def test_real_wordnet_substitution_uses_synonyms(tokenizer):
    aug = A.build_augmenter(AugmentConfig(methods="subs"), tokenizer)
    syn = load_synonyms("/usr/share/wordnet")  # the cache the augmenter uses too
    text = "the big car drove fast down the happy road"
    ids = np.array(tokenizer.encode(text))
    changed = 0
    for seed in range(10):
        out = tokenizer.decode(aug(ids, np.random.default_rng(seed))).split()
        assert len(out) == len(text.split())  # one-word synonyms only
        for a, b in zip(text.split(), out):
            if a != b:
                assert b in syn[a], (a, b)
                changed += 1
    # round(0.3 * 9) = 3 words per call whenever three candidates encode without [UNK].
    assert changed > 0
    again = pickle.loads(pickle.dumps(aug))
    assert again(ids, np.random.default_rng(3)).tolist() == aug(ids, np.random.default_rng(3)).tolist()


def test_vocabulary_without_del_drops_deleted_words():
    """An imported HF BERT vocabulary has no [DEL]: the same draws delete the words without a marker."""
    words = make_words(np.random.default_rng(5), 30)
    cfg = AugmentConfig(methods="del-span")
    with_del = A.Augmenter(cfg, A.parse_methods(cfg.methods), WS, DEL, tokenizer=None)
    without = A.Augmenter(cfg, A.parse_methods(cfg.methods), WS, None, tokenizer=None)
    marked = with_del(flat(words), np.random.default_rng(3))
    dropped = without(flat(words), np.random.default_rng(3))
    assert DEL in marked.tolist()
    assert dropped.tolist() == [t for t in marked.tolist() if t != DEL]
    assert dropped.max() < VOCAB
