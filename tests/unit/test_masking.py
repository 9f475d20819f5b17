"""MLM masking: exact draws for a fixed generator, 15% / 80-10-10 statistics, specials untouched.

Every rate is checked against its expectation within ``Z`` standard deviations computed for that count
(binomial for the per-token actions, the selection's own rounding variance for the 15%), not a fixed tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest

from pretrain.config.data import MaskingConfig
from pretrain.data.masking import IGNORE_INDEX, mask_tokens, random_non_special
from pretrain.data.ragged import Ragged

SPECIALS = (0, 1, 2, 3, 4, 5)
MASK_ID = 4
VOCAB = 50
Z = 5.0
"""Standard deviations a measured rate may be from its expectation (two-sided tail ~6e-7 per check)."""


def binomial_bound(p: float, n: int) -> float:
    """Z standard deviations of the fraction of successes in n Bernoulli(p) trials."""
    return Z * np.sqrt(p * (1 - p) / n)


def selection_bound(num_rows: int, num_maskable: int) -> float:
    """Z standard deviations of the selected fraction: a row selects floor(prob * N + u) of its N, whose distance
    from prob * N is a Bernoulli of its fractional part (variance <= 1/4), independently per row."""
    return Z * np.sqrt(num_rows / 4) / num_maskable


def sequence(rng: np.random.Generator, n: int) -> np.ndarray:
    """[CLS] words... [SEP] with some [UNK]/[DEL] specials sprinkled in."""
    ids = rng.integers(6, VOCAB, size=n)
    ids[rng.random(n) < 0.05] = 1
    ids[rng.random(n) < 0.05] = 5
    return np.concatenate([[2], ids, [3]])


def test_exact_draws_match_direct_computation():
    cfg = MaskingConfig()
    ids = sequence(np.random.default_rng(7), 60)
    inp, labels = mask_tokens(ids, np.random.default_rng(123), cfg, vocab_size=VOCAB, special_ids=SPECIALS,
                              mask_id=MASK_ID)
    # Replay the same generator stream by hand.
    rng = np.random.default_rng(123)
    cands = [i for i, t in enumerate(ids.tolist()) if t not in SPECIALS]
    k = int(np.floor(0.15 * len(cands) + rng.random()))
    chosen = sorted(rng.choice(np.array(cands), size=k, replace=False).tolist())
    u = rng.random(k)
    expected_labels = [-100] * len(ids)
    for p in chosen:
        expected_labels[p] = int(ids[p])
    assert labels.tolist() == expected_labels
    n_rand = int(((u >= 0.8) & (u < 0.9)).sum())
    allowed = [t for t in range(VOCAB) if t not in SPECIALS]
    rand_vals = [allowed[j] for j in rng.integers(0, len(allowed), size=n_rand).tolist()] if n_rand else []
    expected = ids.copy()
    r = iter(rand_vals)
    for p, uu in zip(chosen, u.tolist()):
        if uu < 0.8:
            expected[p] = MASK_ID
        elif uu < 0.9:
            expected[p] = next(r)
    assert inp.tolist() == expected.tolist()


def test_statistics_over_many_samples():
    cfg = MaskingConfig()
    data_rng = np.random.default_rng(0)
    selected = maskable = n_mask = n_rand = n_keep = 0
    for seed in range(400):
        ids = sequence(data_rng, 100)
        inp, labels = mask_tokens(ids, np.random.default_rng(seed), cfg, vocab_size=VOCAB, special_ids=SPECIALS,
                                  mask_id=MASK_ID)
        special = np.isin(ids, SPECIALS)
        sel = labels != IGNORE_INDEX
        assert not (sel & special).any(), "a special token was selected for prediction"
        assert (inp[special] == ids[special]).all() and (inp[~sel] == ids[~sel]).all()
        assert (labels[sel] == ids[sel]).all()
        assert not np.isin(inp[sel & (inp != MASK_ID)], SPECIALS).any()
        selected += sel.sum()
        maskable += (~special).sum()
        n_mask += (inp[sel] == MASK_ID).sum()
        changed = sel & (inp != MASK_ID) & (inp != ids)
        n_rand += changed.sum()
        n_keep += (sel & (inp == ids)).sum()
    assert abs(selected / maskable - 0.15) < selection_bound(400, maskable)
    assert abs(n_mask / selected - 0.8) < binomial_bound(0.8, selected)
    # A random replacement hits the original token with probability 1/44; count those as "random".
    p_same = 1 / (VOCAB - len(SPECIALS))
    p_rand, p_keep = 0.1 * (1 - p_same), 0.1 + 0.1 * p_same
    assert abs(n_rand / selected - p_rand) < binomial_bound(p_rand, selected)
    assert abs(n_keep / selected - p_keep) < binomial_bound(p_keep, selected)


def test_random_replacement_covers_exactly_the_non_special_ids():
    specials = np.array([0, 3, 7, 9])
    rng = np.random.default_rng(1)
    vals = random_non_special(rng, 20000, 12, specials)
    counts = np.bincount(vals, minlength=12)
    assert set(np.flatnonzero(counts).tolist()) == {1, 2, 4, 5, 6, 8, 10, 11}
    frac = counts[counts > 0] / len(vals)
    assert np.abs(frac - 1 / 8).max() < binomial_bound(1 / 8, len(vals))


def test_short_and_all_special_inputs():
    cfg = MaskingConfig()
    ids = np.array([2, 3])
    inp, labels = mask_tokens(ids, np.random.default_rng(0), cfg, vocab_size=VOCAB, special_ids=SPECIALS,
                              mask_id=MASK_ID)
    assert inp.tolist() == [2, 3] and labels.tolist() == [-100, -100]


@pytest.mark.parametrize("kw", [dict(prob=0.0), dict(prob=1.0), dict(mask_frac=0.9, random_frac=0.2)])
def test_config_rejects_bad_values(kw):
    with pytest.raises(ValueError, match="data.masking"):
        MaskingConfig(**kw)


def test_mask_batch_rows_equal_the_row_by_row_reference():
    import augment_reference as R

    from pretrain.data.counter_rng import sample_keys
    from pretrain.data.masking import mask_batch, special_table

    cfg = MaskingConfig()
    special_V, allowed_A = special_table(VOCAB, SPECIALS)
    rng = np.random.default_rng(0)
    for trial in range(30):
        rows = [sequence(rng, int(rng.choice([0, 1, 5, 40, 126]))) for _ in range(int(rng.integers(1, 9)))]
        keys = sample_keys(trial, 2, np.arange(len(rows)))
        batch = Ragged.from_rows(rows)
        inp_BT, labels_BT = mask_batch(batch, keys, cfg, special_V=special_V, allowed_A=allowed_A, mask_id=MASK_ID)
        for b, (row, key) in enumerate(zip(rows, keys.tolist())):
            inp, labels = R.mask(row, key, cfg, SPECIALS, MASK_ID, VOCAB)
            assert inp_BT[b, : len(row)].tolist() == inp and labels_BT[b, : len(row)].tolist() == labels
            assert (labels_BT[b, len(row):] == IGNORE_INDEX).all()


def test_mask_batch_statistics():
    from pretrain.data.counter_rng import sample_keys
    from pretrain.data.masking import mask_batch, special_table

    cfg = MaskingConfig()
    special_V, allowed_A = special_table(VOCAB, SPECIALS)
    rows = [sequence(np.random.default_rng(i), 100) for i in range(400)]
    batch = Ragged.from_rows(rows)
    inp, labels = mask_batch(batch, sample_keys(1, 0, np.arange(400)), cfg, special_V=special_V,
                             allowed_A=allowed_A, mask_id=MASK_ID)
    valid = batch.valid()
    special = special_V[batch.ids] | ~valid
    chosen = labels != IGNORE_INDEX
    assert not (chosen & special).any()  # specials and padding never predicted
    assert abs(chosen.sum() / (~special).sum() - 0.15) < selection_bound(400, (~special).sum())
    n = chosen.sum()
    assert abs((inp[chosen] == MASK_ID).sum() / n - 0.8) < binomial_bound(0.8, n)
    kept = (inp == batch.ids) & chosen
    p_keep = 0.1 + 0.1 / (VOCAB - len(SPECIALS))  # random replacements may hit the original id (1 in 44)
    assert abs(kept.sum() / n - p_keep) < binomial_bound(p_keep, n)
    assert not special_V[inp[chosen & (inp != MASK_ID)]].any()


def test_short_rows_may_select_nothing_and_select_prob_n_on_average():
    """K = floor(prob * N + u): a row of N = 3 maskable tokens selects one with probability 0.45 and none with
    0.55 (no forced minimum, unlike BERT's max(1, ...): E[K] = prob * N exactly); a row with none is unchanged
    and all its labels are ignored (the MLM term divides by the count over all ranks, skipping a zero total)."""
    from pretrain.data.counter_rng import sample_keys
    from pretrain.data.masking import mask_batch, special_table

    special_V, allowed_A = special_table(VOCAB, SPECIALS)
    n = 4000
    row = np.array([2, 10, 11, 12, 3])
    batch = Ragged.from_rows([row] * n)
    inp, labels = mask_batch(batch, sample_keys(9, 0, np.arange(n)), MaskingConfig(), special_V=special_V,
                             allowed_A=allowed_A, mask_id=MASK_ID)
    count_B = (labels != IGNORE_INDEX).sum(axis=1)
    assert set(count_B.tolist()) == {0, 1}
    assert abs(count_B.mean() - 0.45) < binomial_bound(0.45, n)
    none = count_B == 0
    assert (inp[none] == row).all() and (labels[none] == IGNORE_INDEX).all()


def test_random_replacement_draws_only_non_special_ids_inside_the_vocabulary():
    """With an imported BERT's special ids ([PAD] 0, [UNK] 100, [CLS] 101, [SEP] 102, [MASK] 103) scattered in the
    vocabulary, a random replacement is uniform over exactly the other ids below vocab_size."""
    from pretrain.data.counter_rng import sample_keys
    from pretrain.data.masking import mask_batch, special_table

    vocab, specials, mask_id = 120, (0, 100, 101, 102, 103), 103
    special_V, allowed_A = special_table(vocab, specials)
    rng = np.random.default_rng(4)
    rows = [np.concatenate([[101], rng.choice(allowed_A, size=60), [102]]) for _ in range(1000)]
    cfg = MaskingConfig(prob=0.5, mask_frac=0.0, random_frac=1.0)  # every selected token replaced at random
    batch = Ragged.from_rows(rows)
    inp, labels = mask_batch(batch, sample_keys(0, 0, np.arange(len(rows))), cfg, special_V=special_V,
                             allowed_A=allowed_A, mask_id=mask_id)
    drawn = inp[labels != IGNORE_INDEX]
    counts = np.bincount(drawn, minlength=vocab)
    assert len(counts) == vocab and counts[list(specials)].sum() == 0
    assert (counts[allowed_A] > 0).all()
    p = 1 / len(allowed_A)
    assert (np.abs(counts[allowed_A] / len(drawn) - p) < binomial_bound(p, len(drawn))).all()


# ---------------------------------------------------------------------------------- whole-word and span masking

WORD_START = np.array([True] * 6 + [True] * 24 + [False] * 20)
"""ids 6..29 start a word, 30..49 continue one (like ``##`` pieces); specials start words."""


def _worded(rng: np.random.Generator, n: int) -> np.ndarray:
    """``sequence`` whose first word token is a word start (a row may still begin with a continuation)."""
    ids = sequence(rng, n)
    if n and rng.random() < 0.8:
        ids[1] = 6 + ids[1] % 24
    return ids


@pytest.mark.parametrize("scheme", ["whole_word", "span"])
def test_word_schemes_equal_the_row_by_row_reference(scheme):
    import augment_reference as R

    from pretrain.data.counter_rng import sample_keys
    from pretrain.data.masking import mask_batch, special_table

    reference = R.mask_whole_words if scheme == "whole_word" else R.mask_spans
    special_V, allowed_A = special_table(VOCAB, SPECIALS)
    rng = np.random.default_rng(5)
    rows_checked = chosen_total = 0
    for trial in range(60):
        cfg = MaskingConfig(scheme=scheme, prob=float(rng.choice([0.15, 0.4])), span_p=float(rng.choice([0.2, 0.5])),
                            span_max=int(rng.choice([1, 3, 10])))
        rows = [_worded(rng, int(rng.choice([0, 1, 3, 20, 126]))) for _ in range(int(rng.integers(1, 9)))]
        keys = sample_keys(trial, 1, np.arange(len(rows)))
        inp_BT, labels_BT = mask_batch(Ragged.from_rows(rows), keys, cfg, special_V=special_V, allowed_A=allowed_A,
                                       mask_id=MASK_ID, word_start_V=WORD_START)
        for b, (row, key) in enumerate(zip(rows, keys.tolist())):
            inp, labels = reference(row, key, cfg, SPECIALS, MASK_ID, VOCAB, WORD_START)
            assert inp_BT[b, : len(row)].tolist() == inp and labels_BT[b, : len(row)].tolist() == labels
            assert (labels_BT[b, len(row):] == IGNORE_INDEX).all()
            rows_checked += 1
            chosen_total += sum(x != IGNORE_INDEX for x in labels)
    assert rows_checked > 200 and chosen_total > 500


def _batch(scheme, n_rows=400, length=120, **kw):
    from pretrain.data.counter_rng import sample_keys
    from pretrain.data.masking import mask_batch, special_table

    cfg = MaskingConfig(scheme=scheme, **kw)
    special_V, allowed_A = special_table(VOCAB, SPECIALS)
    batch = Ragged.from_rows([_worded(np.random.default_rng(i), length) for i in range(n_rows)])
    inp, labels = mask_batch(batch, sample_keys(3, 0, np.arange(n_rows)), cfg, special_V=special_V,
                             allowed_A=allowed_A, mask_id=MASK_ID, word_start_V=WORD_START)
    return cfg, batch, inp, labels, special_V


def _starts_word(row: list[int], j: int) -> bool:
    """Position j of ``row`` begins a word: a word-start id, or a special, or right after a special."""
    return j == 0 or WORD_START[row[j]] or row[j] in SPECIALS or row[j - 1] in SPECIALS


def _word_ids(row: np.ndarray) -> np.ndarray:
    return np.cumsum([_starts_word(row.tolist(), j) for j in range(len(row))]) - 1


def test_whole_word_masking_takes_whole_words_and_keeps_15_percent_and_80_10_10():
    _, batch, inp, labels, special_V = _batch("whole_word")
    chosen = labels != IGNORE_INDEX
    maskable = batch.valid() & ~special_V[batch.ids]
    assert not (chosen & ~maskable).any()
    for b, row in enumerate(batch.rows()):
        wid = _word_ids(row)
        for q in np.unique(wid[chosen[b, : len(row)]]):  # every token of a chosen word is chosen
            assert chosen[b, : len(row)][(wid == q) & maskable[b, : len(row)]].all()
    # Selected tokens of a row: the sizes of K = floor(0.15 N_w + u) of its N_w words, drawn without replacement.
    # E = 0.15 N exactly; Var <= E[K] var(size) + mean(size)^2 / 4 (the words drawn, then the rounding of K).
    var = 0.0
    for b, row in enumerate(batch.rows()):
        m = maskable[b, : len(row)]
        sizes = np.bincount(_word_ids(row)[m])
        sizes = sizes[sizes > 0]
        var += 0.15 * len(sizes) * sizes.var() + sizes.mean() ** 2 / 4
    assert abs(chosen.sum() / maskable.sum() - 0.15) < Z * np.sqrt(var) / maskable.sum()
    n = chosen.sum()
    p_keep = 0.1 + 0.1 / (VOCAB - len(SPECIALS))  # a random replacement may draw the original id
    assert abs((inp[chosen] == MASK_ID).sum() / n - 0.8) < binomial_bound(0.8, n)
    assert abs(((inp == batch.ids) & chosen).sum() / n - p_keep) < binomial_bound(p_keep, n)
    assert not special_V[inp[chosen & (inp != MASK_ID)]].any()


def test_span_masking_selects_exactly_k_tokens_in_word_spans_with_one_action_per_span():
    from pretrain.data.counter_rng import sample_keys
    from pretrain.data.masking import _spans

    cfg, batch, inp, labels, special_V = _batch("span")
    chosen = labels != IGNORE_INDEX
    maskable = batch.valid() & ~special_V[batch.ids]
    assert not (chosen & ~maskable).any()
    # K = floor(0.15 N + u): within one of 0.15 N, and 15% over the batch.
    assert (np.abs(chosen.sum(axis=1) - 0.15 * maskable.sum(axis=1)) < 1).all()
    assert abs(chosen.sum() / maskable.sum() - 0.15) < selection_bound(len(batch.len), maskable.sum())
    for b, row in enumerate(batch.rows()):
        c = chosen[b, : len(row)]
        for s in np.flatnonzero(c & ~np.concatenate([[False], c[:-1]])):
            assert _starts_word(row.tolist(), s), "a span starts inside a word"
    # Span-level 80/10/10: the tokens a span chose (grouped by its anchor) are all [MASK] or none is, and a span
    # is [MASK]ed with probability 0.8 (its anchor's action draw), independently of the others.
    same_chosen, anchor_BT = _spans(batch, sample_keys(3, 0, np.arange(len(batch.len))), cfg, maskable, WORD_START)
    assert np.array_equal(same_chosen, chosen)
    b, t = np.nonzero(chosen)
    spans, span_of = np.unique(np.stack([b, anchor_BT[b, t]], axis=1), axis=0, return_inverse=True)
    masked_tokens = np.bincount(span_of.ravel(), weights=inp[b, t] == MASK_ID, minlength=len(spans))
    span_tokens = np.bincount(span_of.ravel(), minlength=len(spans))
    assert ((masked_tokens == 0) | (masked_tokens == span_tokens)).all()
    assert abs((masked_tokens > 0).mean() - 0.8) < binomial_bound(0.8, len(spans))


def test_span_lengths_follow_spanberts_truncated_geometric():
    from pretrain.data.masking import span_lengths

    u = np.random.default_rng(0).random(400_000)
    lengths = span_lengths(u, 0.2, 10)
    assert lengths.min() == 1 and lengths.max() == 10
    pmf = np.array([0.2 * 0.8 ** (k - 1) for k in range(1, 11)])
    pmf /= pmf.sum()
    got = np.bincount(lengths, minlength=11)[1:] / len(u)
    assert (np.abs(got - pmf) < binomial_bound(pmf, len(u))).all()
    k = np.arange(1, 11)
    mean, sd = (k * pmf).sum(), np.sqrt((k * k * pmf).sum() - (k * pmf).sum() ** 2)
    assert round(mean, 1) == 3.8  # SpanBERT: mean span length 3.8 words
    assert abs(lengths.mean() - mean) < Z * sd / np.sqrt(len(u))
    assert (span_lengths(u[:100], 1.0, 10) == 1).all() and (span_lengths(u[:100], 0.2, 1) == 1).all()


def test_word_schemes_need_the_word_starts_and_check_their_options():
    from pretrain.data.masking import mask_batch, special_table

    special_V, allowed_A = special_table(VOCAB, SPECIALS)
    with pytest.raises(ValueError, match="word_start_V"):
        mask_batch(Ragged.from_rows([sequence(np.random.default_rng(0), 5)]), np.zeros(1, np.uint64),
                   MaskingConfig(scheme="span"), special_V=special_V, allowed_A=allowed_A, mask_id=MASK_ID)
    for kw, words in (({"scheme": "words"}, "data.masking.scheme"), ({"span_p": 0.0}, "data.masking.span_p"),
                      ({"span_max": 0}, "data.masking.span_max")):
        with pytest.raises(ValueError, match=words):
            MaskingConfig(**kw)
