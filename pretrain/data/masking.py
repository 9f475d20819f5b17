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

__all__ = ["IGNORE_INDEX", "mask_tokens", "with_cls_sep"]


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
