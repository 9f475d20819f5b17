"""A micro-batch of variable-length token rows as one padded array, and the vectorised row operations the
sample pipeline is built from (word layout, k-smallest choice, compaction, span cover, word reassembly).

Shape legend: B = rows, T = padded tokens, W = padded words, K = padded picks (spans), P = pool tokens.
Entries past a row's length are 0 in every array these functions return (so they index any table).
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np


class Ragged(NamedTuple):
    ids: np.ndarray
    """int64 [B, T]; row b's tokens are ids[b, :len[b]], the rest 0."""
    len: np.ndarray
    """int64 [B]."""

    def valid(self) -> np.ndarray:
        """bool [B, T]: True on real tokens."""
        return np.arange(self.ids.shape[1]) < self.len[:, None]

    def rows(self) -> list[np.ndarray]:
        return [self.ids[b, :n] for b, n in enumerate(self.len.tolist())]

    @staticmethod
    def from_rows(rows: list, width: int | None = None) -> "Ragged":
        """Pack 1-D int arrays (each cut to ``width`` tokens when given) into a Ragged."""
        len_B = np.array([len(r) if width is None else min(len(r), width) for r in rows], dtype=np.int64)
        ids = np.zeros((len(rows), int(len_B.max(initial=0))), dtype=np.int64)
        for b, (r, n) in enumerate(zip(rows, len_B.tolist())):
            ids[b, :n] = r[:n]
        return Ragged(ids, len_B)

    def truncate(self, width: int) -> "Ragged":
        if self.ids.shape[1] <= width:
            return self
        return Ragged(self.ids[:, :width], np.minimum(self.len, width))

    def wrap(self, first: int, last: int) -> "Ragged":
        """``first`` tokens ``last`` on every row ([CLS] ... [SEP])."""
        B, T = self.ids.shape
        out = np.zeros((B, T + 2), dtype=np.int64)
        out[:, 0] = first
        out[:, 1 : T + 1] = self.ids
        out[np.arange(B), self.len + 1] = last
        return Ragged(out, self.len + 2)


def compact(ids_BT: np.ndarray, keep_BT: np.ndarray) -> Ragged:
    """The kept tokens of each row, in order, moved to the front."""
    len_B = keep_BT.sum(axis=1, dtype=np.int64)
    out = np.zeros((len(ids_BT), int(len_B.max(initial=0))), dtype=np.int64)
    b, t = np.nonzero(keep_BT)
    out[b, (np.cumsum(keep_BT, axis=1) - 1)[b, t]] = ids_BT[b, t]
    return Ragged(out, len_B)


_NEVER = np.uint64(np.iinfo(np.uint64).max)


def smallest_k(keys_BJ: np.ndarray, ok_BJ: np.ndarray, k_B: np.ndarray) -> np.ndarray:
    """bool [B, J]: in each row, the ``k`` allowed columns with the smallest keys (``counter_rng.draw_keys``,
    distinct within a row; ``k`` at most the number of allowed columns).

    With keys from independent uniform draws this is a uniform choice of k of the allowed columns without
    replacement; a row's choice depends only on its own allowed keys, not on the padded width."""
    B, J = keys_BJ.shape
    active = k_B > 0
    if J == 0 or not active.any():
        return np.zeros((B, J), dtype=bool)
    keys_BJ = np.where(ok_BJ, keys_BJ, _NEVER)
    kth = np.maximum(k_B - 1, 0)
    part_BJ = np.partition(keys_BJ, np.unique(kth[active]), axis=1)
    threshold_B = part_BJ[np.arange(B), kth]
    return (keys_BJ <= threshold_B[:, None]) & ok_BJ & active[:, None]


class Words(NamedTuple):
    """Word layout of a Ragged: a word is a word-start token plus the continuation tokens after it."""

    index: np.ndarray
    """int64 [B, T]: word of each token (0 on padding)."""
    num: np.ndarray
    """int64 [B]: words per row."""
    first: np.ndarray
    """int64 [B, W]: position of each word's first token (the row length past the last word)."""
    size: np.ndarray
    """int64 [B, W]: tokens per word (0 past the last word)."""

    def valid(self) -> np.ndarray:
        return np.arange(self.first.shape[1]) < self.num[:, None]


def rows_of(a: np.ndarray) -> np.ndarray:
    """int64 [B, 1]: row numbers, to index ``a[rows_of(a), columns_BJ]`` (take_along_axis without its overhead)."""
    return np.arange(len(a))[:, None]


def words(r: Ragged, word_start_V: np.ndarray, *, also_BT: np.ndarray | None = None) -> Words:
    """Words of every row; position 0 of a non-empty row always starts a word, and so does every position where
    ``also_BT`` (bool [B, T]) is True."""
    valid = r.valid()
    start_BT = (word_start_V[r.ids] if also_BT is None else word_start_V[r.ids] | also_BT) & valid
    if start_BT.shape[1]:
        start_BT[:, 0] = valid[:, 0]
    index_BT = np.maximum(np.cumsum(start_BT, axis=1) - 1, 0)
    num_B = start_BT.sum(axis=1, dtype=np.int64)
    W = int(num_B.max(initial=0))
    first_BW = np.repeat(r.len[:, None], W, axis=1)
    b, t = np.nonzero(start_BT)
    first_BW[b, index_BT[b, t]] = t
    size_BW = np.diff(np.concatenate([first_BW, r.len[:, None]], axis=1), axis=1)
    return Words(index_BT, num_B, first_BW, size_BW)


def span_cover(starts_BK: np.ndarray, ok_BK: np.ndarray, span_len_B: np.ndarray, W: int) -> np.ndarray:
    """int64 [B, W]: for each word, the index (0..K-1) of the span covering it, -1 when none covers it.

    Spans are [start, start + span_len) and must not overlap; span k of a row is the k-th allowed one."""
    B = len(starts_BK)
    opens = np.zeros((B, W + 1), dtype=np.int64)
    closes = np.zeros((B, W + 1), dtype=np.int64)
    b, k = np.nonzero(ok_BK)
    s = starts_BK[b, k]
    opens[b, s] = 1
    closes[b, s + span_len_B[b]] = 1
    inside = np.cumsum(opens - closes, axis=1)[:, :W] > 0
    return np.where(inside, np.cumsum(opens, axis=1)[:, :W] - 1, -1)


def assemble(r: Ragged, w: Words, source_BW: np.ndarray, pool_P: np.ndarray | None = None,
             pool_start_BW: np.ndarray | None = None, pool_size_BW: np.ndarray | None = None) -> Ragged:
    """Rows rebuilt word by word: output word q of row b is input word ``source_BW[b, q]`` (q < num words), or,
    where ``pool_start_BW[b, q] >= 0``, the ``pool_size_BW[b, q]`` tokens of ``pool_P`` from that start."""
    B, W = source_BW.shape
    R = rows_of(source_BW)
    size_BW = w.size[R, source_BW] * w.valid()
    from_pool_BW = np.zeros((B, W), dtype=bool) if pool_start_BW is None else pool_start_BW >= 0
    if pool_start_BW is not None:
        size_BW = np.where(from_pool_BW, pool_size_BW, size_BW)
    end_BW = np.cumsum(size_BW, axis=1)
    len_B = end_BW[:, -1] if W else np.zeros(B, dtype=np.int64)
    T = int(len_B.max(initial=0))
    begin_BW = end_BW - size_BW
    # Output word of each output token: count the word beginnings at or before it.
    marks = np.zeros((B, T + 1), dtype=np.int64)
    b, q = np.nonzero(size_BW > 0)
    marks[b, begin_BW[b, q]] = 1
    q_BT = np.maximum(np.cumsum(marks[:, :T], axis=1) - 1, 0)
    offset_BT = np.arange(T) - begin_BW[R, q_BT]
    src_tok_BT = w.first[R, source_BW[R, q_BT]] + offset_BT
    valid = np.arange(T) < len_B[:, None]
    out = r.ids[R, np.clip(src_tok_BT, 0, max(r.ids.shape[1] - 1, 0))]
    if pool_start_BW is not None and pool_P is not None and len(pool_P):
        pool_BT = pool_start_BW[R, q_BT] + offset_BT
        from_pool_BT = from_pool_BW[R, q_BT]
        out = np.where(from_pool_BT, pool_P[np.clip(pool_BT, 0, len(pool_P) - 1)], out)
    return Ragged(np.where(valid, out, 0), len_B)


def insert_before(r: Ragged, rows_K: np.ndarray, pos_K: np.ndarray, token: int) -> Ragged:
    """``token`` inserted before position ``pos_K[k]`` of row ``rows_K[k]`` for each k (pairs distinct, each
    ``0 <= pos < len``), vectorised: every other token moves right by the insertions at or before it."""
    B, T = r.ids.shape
    rows_K, pos_K = np.asarray(rows_K, dtype=np.int64), np.asarray(pos_K, dtype=np.int64)
    if not len(rows_K):
        return r
    order = np.lexsort((pos_K, rows_K))
    rows_K, pos_K = rows_K[order], pos_K[order]
    marks = np.zeros((B, T + 1), dtype=np.int64)
    np.add.at(marks, (rows_K, pos_K), 1)
    shift_BT = np.cumsum(marks[:, :T], axis=1)
    len_B = r.len + np.bincount(rows_K, minlength=B)
    out = np.zeros((B, int(len_B.max(initial=0))), dtype=r.ids.dtype)
    b, t = np.nonzero(r.valid())
    out[b, t + shift_BT[b, t]] = r.ids[b, t]
    first_of_row = np.searchsorted(rows_K, rows_K, side="left")
    out[rows_K, pos_K + np.arange(len(rows_K)) - first_of_row] = token
    return Ragged(out, len_B)
