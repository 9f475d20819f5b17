"""ArcCSE triplet views: nesting, rates, contiguity, whole-word masking, determinism over many seeds."""

from __future__ import annotations

import numpy as np
import pytest

from pretrain.data.triplet_masks import build_triplet_views, mask_counts

MASK = 4


def _sentence(num_words: int, seed: int):
    """Random content ids (>= 10) with words of 1-3 tokens; returns (ids_T, word_starts_W)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(1, 4, size=num_words)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
    ids = rng.integers(10, 1000, size=int(lengths.sum()))
    return ids, starts


def _masked_words(view, starts):
    ends = np.append(starts[1:], len(view))
    per_word = [view[s:e] == MASK for s, e in zip(starts, ends)]
    assert all(w.all() or not w.any() for w in per_word), "a word must be masked whole or not at all"
    return np.array([w.all() for w in per_word])


def _runs(mask_W):
    return int(np.sum(mask_W[1:] & ~mask_W[:-1]) + mask_W[0])


def test_nesting_rates_and_contiguity_over_many_seeds():
    rates1, rates2 = [], []
    for seed in range(400):
        num_words = 25 + seed % 40
        ids, starts = _sentence(num_words, seed)
        rng = np.random.default_rng([7, seed])
        out = build_triplet_views(ids, rng, word_starts=starts, mask_id=MASK, max_segments=2)
        assert out is not None
        v1, v2 = out
        assert v1.shape == v2.shape == ids.shape and v1.dtype == np.int64
        w1, w2 = _masked_words(v1, starts), _masked_words(v2, starts)
        assert not (w1 & ~w2).any(), "mask(s'') must contain mask(s')"
        assert (v1[v1 != MASK] == ids[v1 != MASK]).all() and (v2[v2 != MASK] == ids[v2 != MASK]).all()
        assert w1.sum() == round(0.2 * num_words) and w2.sum() == round(0.4 * num_words)
        assert 1 <= _runs(w1) <= 2
        rates1.append(w1.mean())
        rates2.append(w2.mean())
    assert abs(np.mean(rates1) - 0.2) < 0.01 and abs(np.mean(rates2) - 0.4) < 0.01


def test_positions_are_spread_over_the_sentence():
    num_words = 30
    ids, starts = _sentence(num_words, 0)
    hits = np.zeros(num_words)
    for seed in range(600):
        v1, _ = build_triplet_views(ids, np.random.default_rng(seed), word_starts=starts, mask_id=MASK)
        hits += _masked_words(v1, starts)
    # every word gets masked sometimes, none almost always
    assert hits.min() > 0 and hits.max() < 0.6 * 600


def test_deterministic_per_generator_and_varies_across_seeds():
    ids, starts = _sentence(40, 1)
    a = build_triplet_views(ids, np.random.default_rng(123), word_starts=starts, mask_id=MASK)
    b = build_triplet_views(ids, np.random.default_rng(123), word_starts=starts, mask_id=MASK)
    c = build_triplet_views(ids, np.random.default_rng(124), word_starts=starts, mask_id=MASK)
    assert all((x == y).all() for x, y in zip(a, b))
    assert any((x != y).any() for x, y in zip(a, c))


def test_short_sentences_get_no_triplet():
    ids, starts = _sentence(24, 2)
    assert build_triplet_views(ids, np.random.default_rng(0), word_starts=starts, mask_id=MASK) is None
    assert build_triplet_views(ids, np.random.default_rng(0), word_starts=starts, mask_id=MASK, min_words=24)


def test_mask_counts_and_argument_checks():
    assert mask_counts(25, 0.2, 0.4) == (5, 10)
    assert mask_counts(3, 0.2, 0.4) == (1, 2)
    ids, starts = _sentence(30, 3)
    with pytest.raises(ValueError, match="low < high"):
        build_triplet_views(ids, np.random.default_rng(0), word_starts=starts, mask_id=MASK, low=0.4, high=0.2)
    with pytest.raises(ValueError, match="word_starts"):
        build_triplet_views(ids, np.random.default_rng(0), word_starts=starts[::-1], mask_id=MASK)
