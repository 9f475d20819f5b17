"""ArcCSE triplet views: nested contiguous word masks at ~20% (s') and ~40% (s'').

Shape legend: T = content tokens of one sentence (no [CLS]/[SEP]), W = words.

A sentence of W >= min_words words gets s' with n1 = round(low * W) words masked in 1 to
max_segments contiguous segments, then s'' with n2 = round(high * W) words masked by growing
that mask one bordering word at a time, so mask(s'') is a superset of mask(s') and stays
made of few contiguous runs. Every token of a masked word becomes mask_id (lengths are kept).
All randomness comes from the generator passed in (seeded per (seed, epoch, index) upstream).
"""

from __future__ import annotations

import numpy as np


def build_triplet_views(
    ids_T: np.ndarray,
    rng: np.random.Generator,
    *,
    word_starts: np.ndarray,
    low: float = 0.2,
    high: float = 0.4,
    min_words: int = 25,
    mask_id: int,
    max_segments: int = 2,
) -> tuple[np.ndarray, np.ndarray] | None:
    """(ids1_T, ids2_T) int64 copies of ids_T with ~low / ~high of the words masked, or None if too short.

    word_starts: sorted token index of each word's first token (word w spans up to the next start).
    """
    ids_T = np.asarray(ids_T, dtype=np.int64)
    starts_W = np.asarray(word_starts, dtype=np.int64)
    num_words = len(starts_W)
    if not 0.0 < low < high < 1.0:
        raise ValueError(f"triplet mask rates need 0 < low < high < 1, got low={low} high={high}")
    if num_words and (starts_W[0] < 0 or starts_W[-1] >= len(ids_T) or np.any(np.diff(starts_W) <= 0)):
        raise ValueError("word_starts must be strictly increasing token indices inside ids_T")
    if num_words < max(min_words, 2):
        return None
    n1, n2 = mask_counts(num_words, low, high)
    words1_W = sample_segments(rng, num_words, n1, max_segments)
    words2_W = grow_mask(rng, words1_W, n2 - n1)
    return _apply(ids_T, starts_W, words1_W, mask_id), _apply(ids_T, starts_W, words2_W, mask_id)


def mask_counts(num_words: int, low: float, high: float) -> tuple[int, int]:
    """Words to mask in s' and s'': round(rate * W), with 1 <= n1 < n2 < W."""
    n1 = min(max(1, int(round(low * num_words))), num_words - 2)
    n2 = min(max(n1 + 1, int(round(high * num_words))), num_words - 1)
    return n1, n2


def sample_segments(rng: np.random.Generator, num_words: int, num_masked: int, max_segments: int) -> np.ndarray:
    """Bool mask over W words: num_masked words in k ~ U{1..max_segments} separated contiguous runs."""
    num_free = num_words - num_masked
    k = int(rng.integers(1, max(1, min(max_segments, num_masked, num_free + 1)) + 1))
    # Run lengths: a random composition of num_masked into k positive parts.
    cuts = np.sort(rng.choice(np.arange(1, num_masked), size=k - 1, replace=False)) if k > 1 else np.array([], int)
    runs_K = np.diff(np.concatenate([[0], cuts, [num_masked]]))
    # Gaps: k + 1 non-negative parts of num_free, the k - 1 inner ones at least 1 (runs stay separate).
    spare = num_free - (k - 1)
    bars = np.sort(rng.integers(0, spare + 1, size=k))
    gaps = np.diff(np.concatenate([[0], bars, [spare]]))
    gaps[1:-1] += 1
    mask_W = np.zeros(num_words, dtype=bool)
    pos = 0
    for gap, run in zip(gaps[:-1], runs_K):
        pos += int(gap)
        mask_W[pos : pos + int(run)] = True
        pos += int(run)
    return mask_W


def grow_mask(rng: np.random.Generator, mask_W: np.ndarray, num_extra: int) -> np.ndarray:
    """Superset of mask_W with num_extra more words, each added next to the current mask."""
    out_W = mask_W.copy()
    for _ in range(num_extra):
        left_W = np.zeros_like(out_W)
        left_W[:-1] = out_W[1:]
        right_W = np.zeros_like(out_W)
        right_W[1:] = out_W[:-1]
        border = np.flatnonzero((left_W | right_W) & ~out_W)
        if len(border) == 0:  # empty mask: start anywhere free
            border = np.flatnonzero(~out_W)
        out_W[border[rng.integers(len(border))]] = True
    return out_W




def _apply(ids_T: np.ndarray, starts_W: np.ndarray, words_W: np.ndarray, mask_id: int) -> np.ndarray:
    ends_W = np.append(starts_W[1:], len(ids_T))
    tok_mask_T = np.zeros(len(ids_T), dtype=bool)
    for s, e in zip(starts_W[words_W], ends_W[words_W]):
        tok_mask_T[s:e] = True
    out_T = ids_T.copy()
    out_T[tok_mask_T] = mask_id
    return out_T
