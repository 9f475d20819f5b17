"""CLEAR sentence augmentations (Wu et al. 2020, section 3.3 and 4.1), vectorised over a micro-batch.

Shape legend: B = samples, T = tokens, W = words (a word is a word-start token plus its continuation
sub-tokens, per ``tokenizer.word_start_mask()``), K = picks, V = vocabulary, E = synonym entries.

Every operation works on whole words of a ``Ragged`` batch and draws its noise from ``counter_rng.draws``
(draw j of a stream is a hash of the sample's key), so each row's result depends only on its own tokens and
key. A structural special inside the text (``fixed``: [CLS], [SEP], [PAD], [MASK]; e.g. packing=full's [SEP]
before a document) stays in place: it is never deleted, moved or substituted, and W below counts the other
words (spans run over them as if it were not there). A deletion never takes a text's last word that is not
[DEL]: a one-word text keeps its word (its views differ by dropout only, as 'none'). In words, per row:
  del-word  the ``round(rate * W)`` words with the smallest draws become [DEL] (at most C - 1 of the C
            words that are not [DEL])                                                            (rate 0.7)
            ("we delete 70% tokens": exactly that many words, so each word with probability round(0.7W)/W)
  del-span  ``k`` non-overlapping spans of ``round(frac * W)`` words become [DEL] (fewer spans on short
            inputs, total ≈ num*frac*W, k*L <= C - 1); the spans' places are uniform: k of the ``W - k*L + k`` slots
            with the smallest draws, slot i (ascending) starting at word ``slot + i*(L-1)``      (5 x 5%)
  reorder   ``2k`` spans placed the same way, paired by a random permutation (the order of their draws
            from a second stream), each pair swapped                                            (5 x 5%)
  subs      ``round(rate * W)`` of the words that have a WordNet synonym (smallest draws) get synonym
            ``floor(u * count)`` (u from a second stream); one that tokenizes to [UNK] keeps the word (0.3)
  none      identity (SimCSE-style views that differ only by dropout)
Every deleted word becomes one [DEL] and consecutive [DEL]s are merged into one (the paper's rule), also in
the final view of a combination. Rounding is half-up; spans are at least one word. Combinations
('subs+del-span') apply left to right, method m drawing from its own streams; the two views of a sample
are two rows whose keys are ``counter_rng.derive``d from the sample's key (view 1 and 2).
tests/unit/augment_reference.py restates each rule one row at a time, in plain Python, on the same draws.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from pretrain.config.data import AugmentConfig
from pretrain.data.counter_rng import draw_keys, draws
from pretrain.data.ragged import (
    Ragged,
    Words,
    assemble,
    compact,
    rows_of,
    smallest_k,
    span_cover,
    words,
)
from pretrain.data.wordnet import check_wordnet_dir, load_synonyms

METHODS = ("del-word", "del-span", "reorder", "subs", "none")
MAX_SYNONYM_CACHE = 500_000
STREAMS_PER_METHOD = 4


def method_stream(position: int) -> int:
    """First stream id of the method at ``position`` of a combination (the view is in the row's key)."""
    return STREAMS_PER_METHOD * position


def round_half_up(x: np.ndarray) -> np.ndarray:
    return np.floor(np.asarray(x, dtype=np.float64) + 0.5).astype(np.int64)


def span_plan(num_words_B: np.ndarray, num: int, frac: float, group: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """(span_len_B, k_B) for ``num`` groups of ``group`` spans of ``frac`` of the words each.

    Short inputs get fewer groups, keeping the covered words near ``num * group * frac * W``."""
    span_len_B = np.maximum(1, round_half_up(frac * num_words_B))
    if num == 0 or frac == 0.0:
        return span_len_B, np.zeros_like(span_len_B)
    k_B = np.minimum(np.minimum(num, np.maximum(1, round_half_up(num * frac * num_words_B / span_len_B))),
                     num_words_B // (group * span_len_B))
    return span_len_B, k_B


def place_spans(keys_B: np.ndarray, stream: int, num_words_B: np.ndarray, k_B: np.ndarray,
                span_len_B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(starts_BK ascending, ok_BK) of ``k`` non-overlapping spans of ``span_len`` words in each row.

    Uniform over placements: choose k distinct slots in a line shortened by the span bodies."""
    K = int(k_B.max(initial=0))
    slots_B = num_words_B - k_B * span_len_B + k_B
    J = int(slots_B.max(initial=0))
    chosen_BJ = smallest_k(draw_keys(keys_B, stream, J), np.arange(J) < slots_B[:, None], k_B)
    rank_BJ = np.cumsum(chosen_BJ, axis=1) - 1
    b, j = np.nonzero(chosen_BJ)
    starts_BK = np.zeros((len(keys_B), K), dtype=np.int64)
    starts_BK[b, rank_BJ[b, j]] = j + rank_BJ[b, j] * (span_len_B[b] - 1)
    return starts_BK, np.arange(K) < k_B[:, None]


def layout(r: Ragged, word_start_V: np.ndarray, fixed_V: np.ndarray | None,
           del_id: int | None = None) -> tuple[Words, np.ndarray, np.ndarray, np.ndarray]:
    """(words, order_BM, num_B, content_B): the words of each row (a ``fixed_V`` token is a word by itself), the
    word indices of its M movable words (not fixed; int64 [B, M], left-aligned), their number, and how many of
    them are not [DEL] (``del_id``). Without fixed tokens in a row its movable words are all its words."""
    valid = r.valid()
    if fixed_V is None or not fixed_V[r.ids[valid]].any():
        w = words(r, word_start_V)
        num_B = w.num
        order_BM = np.broadcast_to(np.arange(w.first.shape[1]), w.first.shape)
        movable_BW = w.valid()
    else:
        after_BT = np.zeros(r.ids.shape, dtype=bool)
        after_BT[:, 1:] = fixed_V[r.ids[:, :-1]]
        w = words(r, word_start_V, also_BT=after_BT)
        head_BW = r.ids[rows_of(r.ids), np.minimum(w.first, max(r.ids.shape[1] - 1, 0))]
        movable_BW = w.valid() & ~fixed_V[head_BW]
        num_B = movable_BW.sum(axis=1, dtype=np.int64)
        order_BM = np.zeros((len(num_B), int(num_B.max(initial=0))), dtype=np.int64)
        b, q = np.nonzero(movable_BW)
        order_BM[b, (np.cumsum(movable_BW, axis=1) - 1)[b, q]] = q
    if del_id is None or not order_BM.shape[1]:
        return w, order_BM, num_B, num_B
    head_BM = r.ids[rows_of(order_BM), np.minimum(w.first[rows_of(order_BM), order_BM], max(r.ids.shape[1] - 1, 0))]
    is_del_BM = (head_BM == del_id) & (np.arange(order_BM.shape[1]) < num_B[:, None])
    return w, order_BM, num_B, num_B - is_del_BM.sum(axis=1)


def to_words(values_BM: np.ndarray, order_BM: np.ndarray, num_B: np.ndarray, fill_BW: np.ndarray) -> np.ndarray:
    """``fill_BW`` with movable word m of each row (``order_BM[b, m]``, m < num) set to ``values_BM[b, m]``."""
    out_BW = fill_BW.copy()
    b, m = np.nonzero(np.arange(values_BM.shape[1]) < num_B[:, None])
    out_BW[b, order_BM[b, m]] = values_BM[b, m]
    return out_BW


def merge_deletions(r: Ragged, del_id: int) -> Ragged:
    """Collapse every run of consecutive [DEL] tokens into a single [DEL]."""
    is_del = (r.ids == del_id) & r.valid()
    repeat = np.zeros_like(is_del)
    repeat[:, 1:] = is_del[:, 1:] & is_del[:, :-1]
    if not repeat.any():
        return r
    return compact(r.ids, r.valid() & ~repeat)


def delete_marked_words(r: Ragged, w: Words, dead_BW: np.ndarray, del_id: int) -> Ragged:
    """Every token of a marked word becomes [DEL], then runs of [DEL] are merged."""
    if dead_BW.shape[1] == 0:
        return r
    dead_BT = dead_BW[rows_of(dead_BW), w.index] & r.valid()
    return merge_deletions(Ragged(np.where(dead_BT, del_id, r.ids), r.len), del_id)


def delete_words(r: Ragged, keys_B, stream: int, *, word_start_V, del_id: int, rate: float,
                 fixed_V: np.ndarray | None = None) -> Ragged:
    """del-word: the ``round(rate * W)`` movable words with the smallest draws become [DEL] (merged), at most all
    but one of those that are not [DEL]."""
    w, order_BM, num_B, content_B = layout(r, word_start_V, fixed_V, del_id)
    W = w.first.shape[1]
    movable_BW = to_words(np.ones(order_BM.shape, bool), order_BM, num_B, np.zeros(w.first.shape, bool))
    k_B = np.minimum(round_half_up(rate * num_B), np.maximum(content_B - 1, 0))
    dead_BW = smallest_k(draw_keys(keys_B, stream, W), movable_BW, k_B)
    return delete_marked_words(r, w, dead_BW, del_id)


def delete_spans(r: Ragged, keys_B, stream: int, *, word_start_V, del_id: int, num_spans: int,
                 frac: float, fixed_V: np.ndarray | None = None) -> Ragged:
    """del-span: non-overlapping spans of ``frac`` of the movable words each become one [DEL]; they cover at most
    all but one of the words that are not [DEL]."""
    w, order_BM, num_B, content_B = layout(r, word_start_V, fixed_V, del_id)
    span_len_B, k_B = span_plan(num_B, num_spans, frac)
    k_B = np.minimum(k_B, np.maximum(content_B - 1, 0) // span_len_B)
    starts_BK, ok_BK = place_spans(keys_B, stream, num_B, k_B, span_len_B)
    dead_BM = span_cover(starts_BK, ok_BK, span_len_B, order_BM.shape[1]) >= 0
    dead_BW = to_words(dead_BM, order_BM, num_B, np.zeros(w.first.shape, bool))
    return delete_marked_words(r, w, dead_BW, del_id)


def reorder_spans(r: Ragged, keys_B, stream: int, *, word_start_V, num_pairs: int, frac: float,
                  fixed_V: np.ndarray | None = None) -> Ragged:
    """reorder: ``2 * pairs`` non-overlapping equal spans of movable words, randomly paired, each pair swapped
    (fixed words keep their places)."""
    w, order_BM, num_B, _ = layout(r, word_start_V, fixed_V)
    W, M = w.first.shape[1], order_BM.shape[1]
    span_len_B, k_B = span_plan(num_B, num_pairs, frac, group=2)
    if not k_B.any():
        return r
    starts_BS, ok_BS = place_spans(keys_B, stream, num_B, 2 * k_B, span_len_B)
    S = starts_BS.shape[1]
    perm_BS = np.argsort(np.where(ok_BS, draw_keys(keys_B, stream + 1, S), np.iinfo(np.uint64).max), axis=1)
    partner_BS = np.tile(np.arange(S), (len(k_B), 1))
    b, p = np.nonzero(np.arange(S // 2) < k_B[:, None])
    first, second = perm_BS[b, 2 * p], perm_BS[b, 2 * p + 1]
    partner_BS[b, first], partner_BS[b, second] = second, first
    span_BM = span_cover(starts_BS, ok_BS, span_len_B, M)
    inside = span_BM >= 0
    span_BM = np.maximum(span_BM, 0)
    R = rows_of(span_BM)
    own_start = starts_BS[R, span_BM]
    partner_start = starts_BS[R, partner_BS[R, span_BM]]
    word_M = np.arange(M)
    source_BM = np.where(inside, partner_start + word_M - own_start, word_M)  # in movable words
    source_BW = to_words(order_BM[R, source_BM], order_BM, num_B, np.broadcast_to(np.arange(W), w.first.shape))
    return assemble(r, w, source_BW)


class SynonymTable:
    """Synonyms as token arrays: single-token words in flat arrays indexed by token id, longer words through
    ``multi(word tokens) -> Sequence[np.ndarray]`` (looked up, then cached, per process)."""

    def __init__(self, count_V: np.ndarray, first_entry_V: np.ndarray, entry_start_E: np.ndarray,
                 entry_size_E: np.ndarray, pool_P: np.ndarray,
                 multi: Callable[[tuple[int, ...]], Sequence[np.ndarray]] | None = None):
        self.count_V, self.first_entry_V = count_V, first_entry_V
        self.entry_start_E, self.entry_size_E, self.pool_P = entry_start_E, entry_size_E, pool_P
        self.multi = multi

    @classmethod
    def from_mapping(cls, mapping: dict[tuple[int, ...], Sequence[np.ndarray]], vocab_size: int,
                     multi: Callable[[tuple[int, ...]], Sequence[np.ndarray]] | None = None) -> "SynonymTable":
        """Table of ``mapping``'s single-token words; its longer words are looked up in it (unless ``multi``)."""
        count_V = np.zeros(vocab_size + 1, dtype=np.int64)
        first_entry_V = np.zeros(vocab_size + 1, dtype=np.int64)
        starts, sizes, pool, used = [], [], [], 0
        for word, options in sorted(mapping.items()):
            if len(word) != 1 or not len(options):
                continue
            first_entry_V[word[0]], count_V[word[0]] = len(starts), len(options)
            for ids in options:
                ids = np.asarray(ids, dtype=np.int64)
                starts.append(used)
                sizes.append(len(ids))
                pool.append(ids)
                used += len(ids)
        if multi is None:
            longer = {k: v for k, v in mapping.items() if len(k) > 1}
            multi = longer.get  # a plain dict's get: () for a word without synonyms via the default below
        return cls(count_V, first_entry_V, np.asarray(starts, dtype=np.int64), np.asarray(sizes, dtype=np.int64),
                   np.concatenate(pool) if pool else np.zeros(0, np.int64), multi)

    def lookup_multi(self, word: tuple[int, ...]) -> Sequence[np.ndarray]:
        found = self.multi(word) if self.multi is not None else None
        return found if found is not None else ()


def substitute_synonyms(r: Ragged, keys_B, stream: int, *, word_start_V, rate: float,
                        table: SynonymTable, fixed_V: np.ndarray | None = None) -> Ragged:
    """subs: ``round(rate * W)`` movable words among those with synonyms get one of them, chosen uniformly."""
    w, order_BM, num_B, _ = layout(r, word_start_V, fixed_V)
    W = w.first.shape[1]
    if W == 0:
        return r
    valid_BW = to_words(np.ones(order_BM.shape, bool), order_BM, num_B, np.zeros(w.first.shape, bool))
    head_BW = r.ids[rows_of(r.ids), np.minimum(w.first, max(r.ids.shape[1] - 1, 0))]
    single_BW = (w.size == 1) & valid_BW
    count_BW = np.where(single_BW, table.count_V[np.where(single_BW, head_BW, 0)], 0)
    multi_options = {}
    for b, q in zip(*np.nonzero((w.size > 1) & valid_BW)):
        start = int(w.first[b, q])
        options = table.lookup_multi(tuple(r.ids[b, start : start + int(w.size[b, q])].tolist()))
        if len(options):
            multi_options[b, q] = options
            count_BW[b, q] = len(options)
    k_B = np.minimum((count_BW > 0).sum(axis=1), round_half_up(rate * num_B))
    chosen_BW = smallest_k(draw_keys(keys_B, stream, W), count_BW > 0, k_B)
    pick_BW = np.floor(draws(keys_B, stream + 1, W) * count_BW).astype(np.int64)
    entry_BW = table.first_entry_V[np.where(single_BW, head_BW, 0)] + pick_BW
    use_table = chosen_BW & single_BW
    entry_BW = np.where(use_table, entry_BW, 0)
    pool_start_BW = np.where(use_table, table.entry_start_E[entry_BW] if len(table.entry_start_E) else 0, -1)
    pool_size_BW = np.where(use_table, table.entry_size_E[entry_BW] if len(table.entry_size_E) else 0, 0)
    pool_P = table.pool_P
    extra = [(b, q) for (b, q) in multi_options if chosen_BW[b, q]]
    if extra:
        pieces, used = [pool_P], len(pool_P)
        for b, q in extra:
            ids = np.asarray(multi_options[b, q][int(pick_BW[b, q])], dtype=np.int64)
            pool_start_BW[b, q], pool_size_BW[b, q] = used, len(ids)
            pieces.append(ids)
            used += len(ids)
        pool_P = np.concatenate(pieces)
    source_BW = np.broadcast_to(np.arange(W), (len(keys_B), W))
    return assemble(r, w, source_BW, pool_P, pool_start_BW, pool_size_BW)


class Augmenter:
    """Applies the configured '+'-joined CLEAR augmentations, in order, to a batch of token rows."""

    def __init__(self, cfg: AugmentConfig, methods: tuple[str, ...], word_start_V: np.ndarray, del_id: int | None,
                 synonyms: SynonymTable | None = None, fixed_ids=()):
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
        self.fixed_V = np.zeros(len(self.word_start_V), dtype=bool)
        """bool [V]: tokens that stay in place ([CLS], [SEP], [PAD], [MASK] inside the text)."""
        self.fixed_V[[int(i) for i in fixed_ids if 0 <= int(i) < len(self.fixed_V) and int(i) != del_id]] = True
        if "subs" in methods and synonyms is None:
            raise ValueError("the 'subs' augmentation needs a SynonymTable (build_augmenter makes one from WordNet)")
        self.synonyms = synonyms

    def __call__(self, r: Ragged, keys_B: np.ndarray) -> Ragged:
        """Augmented copies of the rows of ``r`` (no specials added or removed except [DEL]); row b's noise comes
        from key ``keys_B[b]`` (both views of a sample are rows of one call, with keys ``derive``d per view)."""
        c, ws, fx = self.cfg, self.word_start_V, self.fixed_V
        for m, method in enumerate(self.methods):
            s = method_stream(m)
            if method == "del-word":
                r = delete_words(r, keys_B, s, word_start_V=ws, del_id=self.del_id, rate=c.del_word_rate, fixed_V=fx)
            elif method == "del-span":
                r = delete_spans(r, keys_B, s, word_start_V=ws, del_id=self.del_id, num_spans=c.del_span_num,
                                 frac=c.del_span_frac, fixed_V=fx)
            elif method == "reorder":
                r = reorder_spans(r, keys_B, s, word_start_V=ws, num_pairs=c.reorder_pairs, frac=c.reorder_frac,
                                  fixed_V=fx)
            elif method == "subs":
                r = substitute_synonyms(r, keys_B, s, word_start_V=ws, rate=c.subs_rate, table=self.synonyms,
                                        fixed_V=fx)
        # Reordering can bring two [DEL]s together; the paper's rule holds for the final view.
        r = merge_deletions(r, self.del_id)
        if self.drop_deleted:
            r = compact(r.ids, r.valid() & (r.ids != self.del_id))
        return r


class WordNetSynonyms:
    """The WordNet synonyms of a word given as token ids, as token arrays: decoded, looked up, capitalised
    like the word, each synonym tokenized on first use (one that gives [UNK] or nothing stands for the word
    itself) as the word is written: starting with a word-start token where the word does (a byte-level BPE
    without a prefix space, RoBERTa's, gives "glad" as the pieces "g l ad" and " glad" as "Ġg l ad": inserted
    mid-sentence the first would be glued to the word before). Cached per process."""

    def __init__(self, tokenizer, wordnet_dir: str):
        self.tokenizer, self.wordnet_dir = tokenizer, wordnet_dir
        self.word_start_V = np.asarray(tokenizer.word_start_mask(), dtype=bool)
        self._cache: dict[tuple[int, ...], Sequence[np.ndarray]] = {}
        self._encoded: dict[tuple[str, bool], np.ndarray | None] = {}

    def __getstate__(self) -> dict:
        return dict(self.__dict__, _cache={}, _encoded={})  # rebuilt lazily in each worker

    def words_of(self, key: tuple[int, ...]) -> tuple[str, ...]:
        word = self.tokenizer.decode(list(key)).strip()
        if not word.isalpha():
            return ()
        syns = load_synonyms(self.wordnet_dir).get(word.lower(), ())
        return tuple(s.capitalize() for s in syns) if word[0].isupper() else syns

    def __call__(self, key: tuple[int, ...]) -> Sequence[np.ndarray]:
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        if len(self._cache) >= MAX_SYNONYM_CACHE:
            self._cache.clear()
            self._encoded.clear()
        syns = self.words_of(key)
        # (a word may start with the Augmenter's own deletion marker, an id past the vocabulary, and a piece)
        starts = bool(key[0] < len(self.word_start_V) and self.word_start_V[key[0]])
        found = Synonyms(syns, np.asarray(key, dtype=np.int64), lambda text: self.encode(text, starts)) if syns else ()
        self._cache[key] = found
        return found

    def encode(self, text: str, starts: bool = True) -> np.ndarray | None:
        """Token ids of a synonym replacing a word that starts (``starts``) or not with a word-start token, or None
        when it does not tokenize cleanly (empty or [UNK])."""
        if (text, starts) not in self._encoded:
            self._encoded[text, starts] = self._as_word(text, self.tokenizer.encode(text), starts)
        return self._encoded[text, starts]

    def _as_word(self, text: str, ids, starts: bool) -> np.ndarray | None:
        """``ids`` (``text`` encoded) as a word that starts with a word-start token where ``starts``: else ``text``
        encoded after a space, when that gives one. None for an empty or [UNK] encoding."""
        ids = self._clean(ids)
        if ids is not None and starts and not self.word_start_V[ids[0]]:
            spaced = self._clean(self.tokenizer.encode(" " + text))
            if spaced is not None and self.word_start_V[spaced[0]]:
                return spaced
        return ids

    def _clean(self, ids) -> np.ndarray | None:
        ids = np.asarray(ids, dtype=np.int64)
        return ids if len(ids) and not (ids == self.tokenizer.unk_id).any() else None

    def single_token_table(self, word_start_V: np.ndarray, special_ids) -> SynonymTable:
        """Every single-token word of the vocabulary with its synonyms, tokenized once (batched; each as a word
        that starts with a word-start token, as the words of the table do)."""
        specials = set(int(s) for s in special_ids)
        found = {}
        for v in np.flatnonzero(word_start_V).tolist():
            if v not in specials:
                syns = self.words_of((v,))
                if syns:
                    found[v] = syns
        texts = sorted({s for syns in found.values() for s in syns})
        encoded = {t: self._as_word(t, ids, True) for t, ids in zip(texts, self.tokenizer.encode_batch(texts))}
        mapping = {}
        for v, syns in found.items():
            own = np.array([v], dtype=np.int64)
            mapping[(v,)] = [own if ids is None else ids for ids in map(encoded.get, syns)]
        return SynonymTable.from_mapping(mapping, len(word_start_V), multi=self)


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
    """Augmenter for ``cfg.methods``; checks WordNet is installed and tabulates it when 'subs' is requested."""
    methods = parse_methods(cfg.methods)
    table = None
    if "subs" in methods:
        check_wordnet_dir(cfg.wordnet_dir)
        ws = tokenizer.word_start_mask()
        table = WordNetSynonyms(tokenizer, cfg.wordnet_dir).single_token_table(ws, tokenizer.special_ids)
    fixed = (tokenizer.cls_id, tokenizer.sep_id, tokenizer.pad_id, tokenizer.mask_id)  # [UNK] is a word
    return Augmenter(cfg, methods, tokenizer.word_start_mask(), tokenizer.del_id, table, fixed_ids=fixed)
