"""BERT-style MLM masking of one token sequence, driven by an explicit generator.

Shape legend: T = sequence length, K = number of selected (predicted) positions.

Selection follows fairseq: K = floor(prob * N + u) with u ~ U[0, 1) among the N
maskable (non-special) positions, so E[K] = prob * N exactly, chosen without
replacement. Each selected token becomes [MASK] (mask_frac), a random non-special
token (random_frac) or stays unchanged (the rest); its label is the original id.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pretrain.config.data import IGNORE_INDEX, MaskingConfig
from pretrain.data.counter_rng import draw_keys, draws
from pretrain.data.ragged import Ragged, smallest_k

__all__ = ["IGNORE_INDEX", "mask_batch", "mask_tokens", "with_cls_sep"]

MASK_COUNT, MASK_PICK, MASK_ACTION, MASK_RANDOM = 0, 1, 2, 3
"""counter_rng streams of ``mask_batch`` (the views draw from streams >= 16)."""


def mask_tokens(
    ids_T: np.ndarray,
    rng: np.random.Generator,
    cfg: MaskingConfig,
    *,
    vocab_size: int,
    special_ids: Iterable[int],
    mask_id: int,
) -> tuple[np.ndarray, np.ndarray]:
    """Return (input_ids_T, labels_T) int64; labels are -100 where not predicted.

    Positions holding a special id are never selected; the input array is not modified.
    """
    ids_T = np.asarray(ids_T, dtype=np.int64)
    specials_S = np.unique(np.fromiter(special_ids, dtype=np.int64))
    input_T = ids_T.copy()
    labels_T = np.full(ids_T.shape, IGNORE_INDEX, dtype=np.int64)

    candidates = np.flatnonzero(~np.isin(ids_T, specials_S))
    num_select = int(np.floor(cfg.prob * len(candidates) + rng.random()))
    if num_select == 0:
        return input_T, labels_T
    pos_K = np.sort(rng.choice(candidates, size=num_select, replace=False))
    labels_T[pos_K] = ids_T[pos_K]

    u_K = rng.random(num_select)
    to_mask_K = u_K < cfg.mask_frac
    to_random_K = (u_K >= cfg.mask_frac) & (u_K < cfg.mask_frac + cfg.random_frac)
    input_T[pos_K[to_mask_K]] = mask_id
    num_random = int(to_random_K.sum())
    if num_random:
        input_T[pos_K[to_random_K]] = random_non_special(rng, num_random, vocab_size, specials_S)
    return input_T, labels_T


def random_non_special(rng: np.random.Generator, n: int, vocab_size: int, specials_S: np.ndarray) -> np.ndarray:
    """n ids drawn uniformly from range(vocab_size) minus the (sorted, unique) special ids."""
    specials_S = specials_S[(specials_S >= 0) & (specials_S < vocab_size)]
    num_allowed = vocab_size - len(specials_S)
    if num_allowed <= 0:
        raise ValueError(f"vocab_size {vocab_size} leaves no non-special token to sample for MLM random replacement")
    v_N = rng.integers(0, num_allowed, size=n, dtype=np.int64)
    # Shift past each special id in ascending order: maps [0, num_allowed) onto the allowed ids.
    for s in specials_S:
        v_N += v_N >= s
    return v_N


def with_cls_sep(tokens_T: np.ndarray, cls_id: int, sep_id: int) -> np.ndarray:
    """[CLS] tokens [SEP] as int64 (the form every sequence and view of a sample takes)."""
    return np.concatenate([[cls_id], tokens_T, [sep_id]]).astype(np.int64)


def mask_batch(seq: Ragged, keys_B: np.ndarray, cfg: MaskingConfig, *, special_V: np.ndarray,
               allowed_A: np.ndarray, mask_id: int) -> tuple[np.ndarray, np.ndarray]:
    """``mask_tokens``' rule for a batch, on counter-based draws: (input_ids_BT, labels_BT) int64.

    Per row: K = floor(prob * N + u) of the N non-special positions (u: draw 0 of MASK_COUNT), those with the
    smallest MASK_PICK keys (``draw_keys``; key j belongs to position j); a chosen position becomes [MASK] when its
    MASK_ACTION draw a < mask_frac, ``allowed_A[floor(r * A)]`` (r: its MASK_RANDOM draw; ``allowed_A`` the
    sorted non-special ids) when a < mask_frac + random_frac, else stays. Padding: input 0, label -100.
    """
    ids_BT = seq.ids
    T = ids_BT.shape[1]
    candidate_BT = seq.valid() & ~special_V[ids_BT]
    count_B = np.floor(cfg.prob * candidate_BT.sum(axis=1) + draws(keys_B, MASK_COUNT, 1)[:, 0]).astype(np.int64)
    chosen_BT = smallest_k(draw_keys(keys_B, MASK_PICK, T), candidate_BT, count_B)
    labels_BT = np.where(chosen_BT, ids_BT, IGNORE_INDEX)
    action_BT = draws(keys_B, MASK_ACTION, T)
    to_mask = chosen_BT & (action_BT < cfg.mask_frac)
    to_random = chosen_BT & ~to_mask & (action_BT < cfg.mask_frac + cfg.random_frac)
    input_BT = np.where(to_mask, mask_id, ids_BT)
    if to_random.any():
        pick_BT = np.minimum((draws(keys_B, MASK_RANDOM, T) * len(allowed_A)).astype(np.int64), len(allowed_A) - 1)
        input_BT = np.where(to_random, allowed_A[pick_BT], input_BT)
    return input_BT, labels_BT


def special_table(vocab_size: int, special_ids: Iterable[int]) -> tuple[np.ndarray, np.ndarray]:
    """(special_V bool [V], allowed_A: the non-special ids, sorted) for ``mask_batch``."""
    special_V = np.zeros(vocab_size, dtype=bool)
    ids = [int(i) for i in special_ids if 0 <= int(i) < vocab_size]
    special_V[ids] = True
    allowed_A = np.flatnonzero(~special_V).astype(np.int64)
    if not len(allowed_A):
        raise ValueError(f"vocab_size {vocab_size} leaves no non-special token to sample for MLM random replacement")
    return special_V, allowed_A
