"""BERT-style MLM masking of one token sequence, driven by an explicit generator.

Shape legend: T = sequence length, K = number of selected (predicted) positions, B = rows, W = words.

Selection follows fairseq: K = floor(prob * N + u) with u ~ U[0, 1) among the N
maskable (non-special) positions, so E[K] = prob * N exactly, chosen without
replacement. Each selected token becomes [MASK] (mask_frac), a random non-special
token (random_frac) or stays unchanged (the rest); its label is the original id.

``mask_batch`` also selects by ``MaskingConfig.scheme``: ``whole_word`` chooses floor(prob * N_w + u) of the N_w
words (a word: a word-start token and its continuation pieces, ``Tokenizer.word_start_mask``; a special token is a
word of its own), so E[selected
tokens] = prob * N; ``span`` lays spans of whole words of Geometric(span_p) length (truncated to 1..span_max)
from anchor words in random order until exactly K tokens are selected (SpanBERT, Joshi et al. 2020: a span stops
where the budget is reached, and the 80/10/10 choice is made once per span; see ``_spans`` for the one
difference).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from pretrain.config.data import IGNORE_INDEX, MaskingConfig
from pretrain.data.counter_rng import draw_keys, draws
from pretrain.data.ragged import Ragged, rows_of, smallest_k, words

__all__ = ["IGNORE_INDEX", "mask_batch", "mask_tokens", "with_cls_sep"]

MASK_COUNT, MASK_PICK, MASK_ACTION, MASK_RANDOM, MASK_SPAN_LEN = 0, 1, 2, 3, 4
"""counter_rng streams of ``mask_batch``, on the sample's own key (the views draw from keys ``derive``d from it,
one per view: datasets.VIEW_A/VIEW_B). A word's draws are those of its first token's position; a span's action
draw is that of its anchor word's first token."""


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


def mask_batch(seq: Ragged, keys_B: np.ndarray, cfg: MaskingConfig, *, special_V: np.ndarray, allowed_A: np.ndarray,
               mask_id: int, word_start_V: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """``mask_tokens``' rule for a batch, on counter-based draws: (input_ids_BT, labels_BT) int64.

    Per row: K = floor(prob * N + u) of the N non-special positions (u: draw 0 of MASK_COUNT), those with the
    smallest MASK_PICK keys (``draw_keys``; key j belongs to position j); a chosen position becomes [MASK] when its
    MASK_ACTION draw a < mask_frac, ``allowed_A[floor(r * A)]`` (r: its MASK_RANDOM draw; ``allowed_A`` the
    sorted non-special ids) when a < mask_frac + random_frac, else stays. Padding: input 0, label -100.
    Schemes ``whole_word`` and ``span`` (``word_start_V``: bool [V], needed by both) choose the positions as the
    module docstring says; ``span`` takes a position's action draw from its span's anchor.
    """
    ids_BT = seq.ids
    T = ids_BT.shape[1]
    candidate_BT = seq.valid() & ~special_V[ids_BT]
    action_BT = draws(keys_B, MASK_ACTION, T)
    if cfg.scheme == "token":
        count_B = np.floor(cfg.prob * candidate_BT.sum(axis=1) + draws(keys_B, MASK_COUNT, 1)[:, 0]).astype(np.int64)
        chosen_BT = smallest_k(draw_keys(keys_B, MASK_PICK, T), candidate_BT, count_B)
    else:
        if word_start_V is None:
            raise ValueError(f"data.masking.scheme={cfg.scheme} needs the tokenizer's word starts (word_start_V)")
        if cfg.scheme == "whole_word":
            chosen_BT = _whole_words(seq, keys_B, cfg, candidate_BT, word_start_V)
        else:
            chosen_BT, anchor_BT = _spans(seq, keys_B, cfg, candidate_BT, word_start_V)
            action_BT = action_BT[rows_of(action_BT), anchor_BT]
    labels_BT = np.where(chosen_BT, ids_BT, IGNORE_INDEX)
    to_mask = chosen_BT & (action_BT < cfg.mask_frac)
    to_random = chosen_BT & ~to_mask & (action_BT < cfg.mask_frac + cfg.random_frac)
    input_BT = np.where(to_mask, mask_id, ids_BT)
    if to_random.any():
        pick_BT = np.minimum((draws(keys_B, MASK_RANDOM, T) * len(allowed_A)).astype(np.int64), len(allowed_A) - 1)
        input_BT = np.where(to_random, allowed_A[pick_BT], input_BT)
    return input_BT, labels_BT


def _word_table(seq: Ragged, keys_B: np.ndarray, candidate_BT: np.ndarray, word_start_V: np.ndarray):
    """(words, first token of each word clipped into the row (int64 [B, W]), candidate words bool [B, W]:
    those whose first token is maskable, sort keys of the words uint64 [B, W]: MASK_PICK at their first token).
    A special token is a word of its own: the token after it starts a word even when it is a continuation."""
    T = seq.ids.shape[1]
    after_special_BT = np.zeros(seq.ids.shape, dtype=bool)
    after_special_BT[:, 1:] = ~candidate_BT[:, :-1]
    w = words(seq, word_start_V, also_BT=after_special_BT)
    R = rows_of(seq.ids)
    first_BW = np.minimum(w.first, max(T - 1, 0))
    cand_BW = w.valid() & candidate_BT[R, first_BW] if T else w.valid()
    keys_BW = draw_keys(keys_B, MASK_PICK, T)[R, first_BW] if T else np.zeros(w.first.shape, np.uint64)
    return w, first_BW, cand_BW, keys_BW


def _whole_words(seq, keys_B, cfg, candidate_BT, word_start_V) -> np.ndarray:
    """bool [B, T]: all tokens of floor(prob * N_w + u) of the N_w candidate words, chosen by smallest key."""
    w, _, cand_BW, keys_BW = _word_table(seq, keys_B, candidate_BT, word_start_V)
    count_B = np.floor(cfg.prob * cand_BW.sum(axis=1) + draws(keys_B, MASK_COUNT, 1)[:, 0]).astype(np.int64)
    chosen_BW = smallest_k(keys_BW, cand_BW, count_B)
    if not chosen_BW.shape[1]:
        return np.zeros(seq.ids.shape, dtype=bool)
    return chosen_BW[rows_of(chosen_BW), w.index] & candidate_BT


def span_lengths(u, p: float, max_len: int) -> np.ndarray:
    """int64: Geometric(p) on 1.. truncated to 1..max_len, by inverse CDF of uniform draws ``u`` in [0, 1)."""
    if p >= 1.0:
        return np.ones(np.shape(u), dtype=np.int64)
    mass = 1.0 - (1.0 - p) ** max_len
    length = 1 + np.floor(np.log1p(-np.asarray(u) * mass) / np.log1p(-p)).astype(np.int64)
    return np.clip(length, 1, max_len)


def _spans(seq, keys_B, cfg, candidate_BT, word_start_V) -> tuple[np.ndarray, np.ndarray]:
    """(chosen bool [B, T], anchor int64 [B, T]: first token of the anchor word of each chosen token's span).

    Every candidate word anchors a span over itself and the ``length - 1`` words after it (fewer at the row's
    end). Taking the spans in order of their anchors' keys, each adds its maskable tokens not yet chosen, in
    order, until the row holds K = floor(prob * N + u) tokens: so a token's span is the first (in key order) that
    covers it, and the chosen tokens are the K first by (that span's rank, position) — computed at once, without a
    loop over spans. (SpanBERT draws another anchor when one falls inside an earlier span; here such a span still
    adds the words after it.)"""
    B, T = seq.ids.shape
    if not T:
        return np.zeros((B, T), dtype=bool), np.zeros((B, T), dtype=np.int64)
    w, first_BW, cand_BW, keys_BW = _word_table(seq, keys_B, candidate_BT, word_start_V)
    W = first_BW.shape[1]
    R = rows_of(first_BW)
    if not W:
        return np.zeros((B, T), dtype=bool), np.zeros((B, T), dtype=np.int64)
    word_of_rank_BW = np.argsort(np.where(cand_BW, keys_BW, np.iinfo(np.uint64).max), axis=1, kind="stable")
    rank_BW = np.empty((B, W), dtype=np.int64)
    rank_BW[R, word_of_rank_BW] = np.arange(W)
    length_BW = np.where(cand_BW, span_lengths(draws(keys_B, MASK_SPAN_LEN, T)[R, first_BW], cfg.span_p,
                                               cfg.span_max), 0)
    never = W
    best_BW = np.full((B, W), never, dtype=np.int64)  # rank of the first span covering each word
    for d in range(min(cfg.span_max, W)):  # the span anchored d words before word q covers q when longer than d
        np.minimum(best_BW[:, d:], np.where(length_BW[:, :W - d] > d, rank_BW[:, :W - d], never), out=best_BW[:, d:])
    best_BT = best_BW[R, w.index]
    covered_BT = candidate_BT & (best_BT < never)
    budget_B = np.floor(cfg.prob * candidate_BT.sum(axis=1) + draws(keys_B, MASK_COUNT, 1)[:, 0]).astype(np.int64)
    order_BT = (best_BT.astype(np.uint64) << np.uint64(16)) | np.arange(T, dtype=np.uint64)
    chosen_BT = smallest_k(order_BT, covered_BT, np.minimum(budget_B, covered_BT.sum(axis=1)))
    anchor_BT = first_BW[R, word_of_rank_BW[R, np.minimum(best_BT, W - 1)]]
    return chosen_BT, np.where(chosen_BT, anchor_BT, 0)


def special_table(vocab_size: int, special_ids: Iterable[int]) -> tuple[np.ndarray, np.ndarray]:
    """(special_V bool [V], allowed_A: the non-special ids, sorted) for ``mask_batch``."""
    special_V = np.zeros(vocab_size, dtype=bool)
    ids = [int(i) for i in special_ids if 0 <= int(i) < vocab_size]
    special_V[ids] = True
    allowed_A = np.flatnonzero(~special_V).astype(np.int64)
    if not len(allowed_A):
        raise ValueError(f"vocab_size {vocab_size} leaves no non-special token to sample for MLM random replacement")
    return special_V, allowed_A
