"""MLM masking: exact draws for a fixed generator, 15% / 80-10-10 statistics, specials untouched."""

from __future__ import annotations

import numpy as np
import pytest

from pretrain.config.data import MaskingConfig
from pretrain.data.masking import IGNORE_INDEX, mask_tokens, random_non_special

SPECIALS = (0, 1, 2, 3, 4, 5)
MASK_ID = 4
VOCAB = 50


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
    assert abs(selected / maskable - 0.15) < 0.005
    assert abs(n_mask / selected - 0.8) < 0.02
    # A random replacement hits the original token with probability 1/44; count those as "random".
    p_same = 1 / (VOCAB - len(SPECIALS))
    assert abs(n_rand / selected - 0.1 * (1 - p_same)) < 0.012
    assert abs(n_keep / selected - (0.1 + 0.1 * p_same)) < 0.012


def test_random_replacement_covers_exactly_the_non_special_ids():
    specials = np.array([0, 3, 7, 9])
    rng = np.random.default_rng(1)
    vals = random_non_special(rng, 20000, 12, specials)
    counts = np.bincount(vals, minlength=12)
    assert set(np.flatnonzero(counts).tolist()) == {1, 2, 4, 5, 6, 8, 10, 11}
    frac = counts[counts > 0] / len(vals)
    assert np.abs(frac - 1 / 8).max() < 0.01


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
    from pretrain.data.ragged import Ragged

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
    from pretrain.data.ragged import Ragged

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
    assert abs(chosen.sum() / (~special).sum() - 0.15) < 0.005
    n = chosen.sum()
    assert abs((inp[chosen] == MASK_ID).sum() / n - 0.8) < 0.02
    kept = (inp == batch.ids) & chosen
    assert abs(kept.sum() / n - 0.1) < 0.02  # random replacements may hit the original id (1 in 44)
    assert not special_V[inp[chosen & (inp != MASK_ID)]].any()
