"""CLEAR sentence augmentations on token-id arrays (Wu et al. 2020, section 3.3 and 4.1).

Shape legend: T = tokens in, W = words (a word is a word-start token plus its
continuation sub-tokens, per ``tokenizer.word_start_mask()``), V = vocabulary, K = picks.

All operations work on whole words and take an explicit ``np.random.Generator``:
  del-word  replace ``round(rate * W)`` random words by [DEL]                (rate 0.7)
            (each token is deleted with probability 0.7: "we delete 70% tokens")
  del-span  replace ``num`` random non-overlapping spans of ``round(frac * W)``
            words by [DEL] (fewer spans on short inputs, total ≈ num*frac*W) (5 x 5%)
  reorder   pick ``2 * pairs`` non-overlapping spans of ``round(frac * W)`` words,
            pair them at random and swap each pair                           (5 x 5%)
  subs      replace ``round(rate * W)`` random words among those with a WordNet
            synonym by a uniformly chosen synonym (kept if it tokenizes to [UNK]) (rate 0.3)
  none      identity (SimCSE-style views that differ only by dropout)
Every deleted word becomes one [DEL] and consecutive [DEL]s are merged into one (the
paper's rule), also in the final view of a combination. Rounding is half-up; spans are
at least one word. Combinations ('subs+del-span') apply left to right with one generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import numpy as np

from pretrain.config.data import AugmentConfig
from pretrain.data.wordnet import check_wordnet_dir, load_synonyms

METHODS = ("del-word", "del-span", "reorder", "subs", "none")
MAX_SYNONYM_CACHE = 500_000

SynonymLookup = Callable[[tuple[int, ...]], Sequence[np.ndarray]]
"""Word (token ids) -> its synonyms as token arrays (empty when it has none)."""


def round_half_up(x: float) -> int:
    return math.floor(x + 0.5)


def word_starts(ids_T: np.ndarray, word_start_V: np.ndarray) -> np.ndarray:
    """Token positions where words begin, int64[W] (position 0 always starts a word)."""
    if len(ids_T) == 0:
        return np.zeros(0, dtype=np.int64)
    is_start_T = word_start_V[ids_T]
    is_start_T[0] = True
    return np.flatnonzero(is_start_T)


def word_index(ids_T: np.ndarray, word_start_V: np.ndarray) -> np.ndarray:
    """For each token, the index of its word, int64[T]."""
    is_start_T = np.zeros(len(ids_T), dtype=np.int64)
    is_start_T[word_starts(ids_T, word_start_V)] = 1
    return np.cumsum(is_start_T) - 1


def merge_deletions(ids_T: np.ndarray, del_id: int) -> np.ndarray:
    """Collapse every run of consecutive [DEL] tokens into a single [DEL]."""
    is_del_T = ids_T == del_id
    repeat_T = is_del_T.copy()
    repeat_T[0:1] = False
    repeat_T[1:] &= is_del_T[:-1]
    return ids_T[~repeat_T]


def replace_words_by_del(ids_T: np.ndarray, deleted_W: np.ndarray, word_start_V: np.ndarray, del_id: int) -> np.ndarray:
    """Every token of a deleted word becomes [DEL], then runs of [DEL] are merged."""
    out_T = np.array(ids_T, dtype=np.int64, copy=True)
    out_T[deleted_W[word_index(ids_T, word_start_V)]] = del_id
    return merge_deletions(out_T, del_id)


def place_spans(rng: np.random.Generator, num_words: int, num_spans: int, span_len: int) -> np.ndarray:
    """Sorted starts of ``num_spans`` non-overlapping spans of ``span_len`` words in ``num_words``.

    Uniform over placements: choose distinct slots in a line shortened by the span bodies.
    """
    slots_K = np.sort(rng.choice(num_words - num_spans * span_len + num_spans, size=num_spans, replace=False))
    return slots_K + np.arange(num_spans) * (span_len - 1)


def span_plan(num_words: int, num: int, frac: float, group: int = 1) -> tuple[int, int]:
    """(span_len, k) for ``num`` groups of ``group`` spans of ``frac`` of the words each.

    Short inputs get fewer groups, keeping the covered words near ``num * group * frac * W``.
    """
    span_len = max(1, round_half_up(frac * num_words))
    if num == 0 or frac == 0.0:
        return span_len, 0
    k = min(num, max(1, round_half_up(num * frac * num_words / span_len)), num_words // (group * span_len))
    return span_len, k


def delete_words(ids_T: np.ndarray, rng: np.random.Generator, *, word_start_V: np.ndarray, del_id: int, rate: float):
    """del-word: ``round(rate * W)`` words chosen without replacement become [DEL] (merged)."""
    num_words = len(word_starts(ids_T, word_start_V))
    if num_words == 0:
        return np.array(ids_T, dtype=np.int64)
    chosen_K = rng.choice(num_words, size=round_half_up(rate * num_words), replace=False)
    deleted_W = np.zeros(num_words, dtype=bool)
    deleted_W[chosen_K] = True
    return replace_words_by_del(ids_T, deleted_W, word_start_V, del_id)


def delete_spans(
    ids_T: np.ndarray, rng: np.random.Generator, *, word_start_V: np.ndarray, del_id: int, num_spans: int, frac: float
):
    """del-span: non-overlapping spans of ``frac`` of the words each become one [DEL]."""
    num_words = len(word_starts(ids_T, word_start_V))
    if num_words == 0:
        return np.array(ids_T, dtype=np.int64)
    span_len, k = span_plan(num_words, num_spans, frac)
    starts_K = place_spans(rng, num_words, k, span_len)
    deleted_W = np.zeros(num_words, dtype=bool)
    deleted_W[(starts_K[:, None] + np.arange(span_len)).ravel()] = True
    return replace_words_by_del(ids_T, deleted_W, word_start_V, del_id)


def gather_words(ids_T: np.ndarray, starts_W: np.ndarray, order_W: np.ndarray) -> np.ndarray:
    """Tokens of the words in ``order_W`` (indices into ``starts_W``), concatenated."""
    lens_W = np.diff(np.append(starts_W, len(ids_T)))
    new_lens_W = lens_W[order_W]
    out_begin_W = np.cumsum(new_lens_W) - new_lens_W
    idx_T = np.arange(len(ids_T)) - np.repeat(out_begin_W, new_lens_W) + np.repeat(starts_W[order_W], new_lens_W)
    return np.asarray(ids_T, dtype=np.int64)[idx_T]


def reorder_spans(
    ids_T: np.ndarray, rng: np.random.Generator, *, word_start_V: np.ndarray, num_pairs: int, frac: float
):
    """reorder: ``2 * pairs`` non-overlapping equal spans, randomly paired, each pair swapped."""
    starts_W = word_starts(ids_T, word_start_V)
    num_words = len(starts_W)
    span_len, k = span_plan(num_words, num_pairs, frac, group=2)
    if k == 0:
        return np.array(ids_T, dtype=np.int64)
    span_starts_S = place_spans(rng, num_words, 2 * k, span_len)
    pairs_K2 = span_starts_S[rng.permutation(2 * k)].reshape(k, 2)
    order_W = np.arange(num_words)
    for a, b in pairs_K2.tolist():
        span_a = order_W[a : a + span_len].copy()
        order_W[a : a + span_len] = order_W[b : b + span_len]
        order_W[b : b + span_len] = span_a
    return gather_words(ids_T, starts_W, order_W)


def substitute_synonyms(
    ids_T: np.ndarray, rng: np.random.Generator, *, word_start_V: np.ndarray, rate: float, lookup: SynonymLookup
):
    """subs: ``round(rate * W)`` words among those with synonyms get a random synonym's tokens."""
    starts_W = word_starts(ids_T, word_start_V)
    num_words = len(starts_W)
    if num_words == 0:
        return np.array(ids_T, dtype=np.int64)
    ids_T = np.asarray(ids_T, dtype=np.int64)
    ids_l = ids_T.tolist()
    bounds = starts_W.tolist() + [len(ids_l)]
    options = [lookup(tuple(ids_l[bounds[w] : bounds[w + 1]])) for w in range(num_words)]
    candidates_C = np.array([w for w in range(num_words) if len(options[w])], dtype=np.int64)
    k = min(len(candidates_C), round_half_up(rate * num_words))
    if k == 0:
        return ids_T.copy()
    pieces, done = [], 0
    for w in np.sort(rng.choice(candidates_C, size=k, replace=False)).tolist():
        pieces += [ids_T[done : bounds[w]], options[w][int(rng.integers(len(options[w])))]]
        done = bounds[w + 1]
    pieces.append(ids_T[done:])
    return np.concatenate(pieces)


class Augmenter:
    """Applies the configured '+'-joined CLEAR augmentations, in order, to one token array."""

    def __init__(self, cfg: AugmentConfig, methods: tuple[str, ...], word_start_V: np.ndarray, del_id: int | None,
                 tokenizer):
        self.cfg = cfg
        self.methods = methods
        self.word_start_V = np.asarray(word_start_V, dtype=bool).copy()
        # A vocabulary without [DEL] (an imported HF BERT) marks deletions with an id past the vocabulary
        # and drops them at the end: the view loses the words without a marker.
        self.drop_deleted = del_id is None
        if del_id is None:
            del_id = len(self.word_start_V)
            self.word_start_V = np.append(self.word_start_V, True)
        self.word_start_V[del_id] = True  # a merged [DEL] is a word of its own
        self.del_id = del_id
        self.tokenizer = tokenizer if "subs" in methods else None
        self._cache: dict[tuple[int, ...], Sequence[np.ndarray]] = {}
        self._encoded: dict[str, np.ndarray | None] = {}

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["_cache"], state["_encoded"] = {}, {}  # rebuilt lazily in each worker
        return state

    def __call__(self, ids_T: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Augmented copy of ``ids_T`` (int64[T'], no specials added or removed except [DEL])."""
        out_T = np.asarray(ids_T, dtype=np.int64)
        c, ws = self.cfg, self.word_start_V
        for m in self.methods:
            if m == "del-word":
                out_T = delete_words(out_T, rng, word_start_V=ws, del_id=self.del_id, rate=c.del_word_rate)
            elif m == "del-span":
                out_T = delete_spans(
                    out_T, rng, word_start_V=ws, del_id=self.del_id, num_spans=c.del_span_num, frac=c.del_span_frac
                )
            elif m == "reorder":
                out_T = reorder_spans(out_T, rng, word_start_V=ws, num_pairs=c.reorder_pairs, frac=c.reorder_frac)
            elif m == "subs":
                out_T = substitute_synonyms(out_T, rng, word_start_V=ws, rate=c.subs_rate, lookup=self.synonyms_of)
            else:
                out_T = np.array(out_T, dtype=np.int64, copy=True)
        # Reordering can bring two [DEL]s together; the paper's rule holds for the final view.
        out_T = merge_deletions(out_T, self.del_id)
        return out_T[out_T != self.del_id] if self.drop_deleted else out_T

    def synonyms_of(self, key: tuple[int, ...]) -> Sequence[np.ndarray]:
        """The WordNet synonyms of one word as token arrays, tokenized on first use (cached per process)."""
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if len(self._cache) >= MAX_SYNONYM_CACHE:
            self._cache.clear()
            self._encoded.clear()
        word = self.tokenizer.decode(list(key)).strip()
        found: Sequence[np.ndarray] = ()
        if word.isalpha():
            syns = load_synonyms(self.cfg.wordnet_dir).get(word.lower(), ())
            if word[0].isupper():
                syns = tuple(s.capitalize() for s in syns)
            if syns:
                found = Synonyms(syns, np.asarray(key, dtype=np.int64), self.encode_synonym)
        self._cache[key] = found
        return found

    def encode_synonym(self, text: str) -> np.ndarray | None:
        """Token ids of a synonym, or None when it does not tokenize cleanly (empty or [UNK])."""
        if text not in self._encoded:
            ids = np.asarray(self.tokenizer.encode(text), dtype=np.int64)
            self._encoded[text] = ids if len(ids) and not (ids == self.tokenizer.unk_id).any() else None
        return self._encoded[text]


class Synonyms(Sequence):
    """A word's synonyms; item i is synonym i's token ids (the original word if it gives [UNK])."""

    def __init__(self, words: tuple[str, ...], word_T: np.ndarray, encode: Callable[[str], np.ndarray | None]):
        self.words, self.word_T, self.encode = words, word_T, encode

    def __len__(self) -> int:
        return len(self.words)

    def __getitem__(self, i):
        ids = self.encode(self.words[i])
        return self.word_T if ids is None else ids


def parse_methods(methods: str) -> tuple[str, ...]:
    """'subs+del-span' -> ('subs', 'del-span'); ValueError naming the valid choices otherwise."""
    parts = tuple(p.strip() for p in methods.split("+"))
    bad = [p for p in parts if p not in METHODS]
    if bad or not parts:
        raise ValueError(
            f"data.augment.methods={methods!r}: unknown augmentation(s) {bad}; use '+'-joined names from "
            f"{', '.join(METHODS)} (e.g. 'del-span+reorder')"
        )
    return parts


def build_augmenter(cfg: AugmentConfig, tokenizer) -> Augmenter:
    """Augmenter for ``cfg.methods``; checks WordNet is installed when 'subs' is requested."""
    methods = parse_methods(cfg.methods)
    if "subs" in methods:
        check_wordnet_dir(cfg.wordnet_dir)
    return Augmenter(cfg, methods, tokenizer.word_start_mask(), tokenizer.del_id, tokenizer)
