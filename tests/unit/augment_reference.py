"""Slow references for the vectorised sample pipeline: each rule of pretrain.data.augment / masking.mask_batch
restated for one row in plain Python (lists, loops, sorted()), on the same counter-based draws. The vectorised
code must give exactly these rows for every row of every batch."""

from __future__ import annotations

import math

import numpy as np

from pretrain.data.counter_rng import draw_keys, draws


def u(key: int, stream: int, n: int) -> list[float]:
    return draws(np.array([key], dtype=np.uint64), stream, n)[0].tolist()


def order_keys(key: int, stream: int, n: int) -> list[int]:
    return [int(x) for x in draw_keys(np.array([key], dtype=np.uint64), stream, n)[0]]


def smallest(keys: list[int], allowed, k: int) -> list[int]:
    """The k allowed indices with the smallest keys."""
    return sorted(allowed, key=lambda j: keys[j])[:k]


def rhu(x: float) -> int:
    return math.floor(x + 0.5)


def split_words(tokens: list[int], word_start, fixed=frozenset()) -> list[list[int]]:
    """Words: a word start and the continuation tokens after it; a ``fixed`` token is a word by itself."""
    out: list[list[int]] = []
    for i, t in enumerate(tokens):
        if i == 0 or word_start[t] or t in fixed or tokens[i - 1] in fixed:
            out.append([t])
        else:
            out[-1].append(t)
    return out


def movable(words: list[list[int]], fixed) -> list[int]:
    """Indices of the words that are not a fixed token (those stay where they are)."""
    return [q for q, w in enumerate(words) if w[0] not in fixed]


def content(words: list[list[int]], fixed, del_id: int) -> int:
    """How many movable words do not start with [DEL]: a deletion leaves one of them."""
    return sum(words[q][0] != del_id for q in movable(words, fixed))


def merge(tokens: list[int], del_id: int) -> list[int]:
    out: list[int] = []
    for t in tokens:
        if not (t == del_id and out and out[-1] == del_id):
            out.append(t)
    return out


def with_dels(words: list[list[int]], dead: set[int], del_id: int) -> list[int]:
    return merge([t for w, toks in enumerate(words) for t in ([del_id] if w in dead else toks)], del_id)


def plan(num_words: int, num: int, frac: float, group: int = 1) -> tuple[int, int]:
    span_len = max(1, rhu(frac * num_words))
    if num == 0 or frac == 0.0:
        return span_len, 0
    return span_len, min(num, max(1, rhu(num * frac * num_words / span_len)), num_words // (group * span_len))


def place(key: int, stream: int, num_words: int, k: int, span_len: int) -> list[int]:
    slots = num_words - k * span_len + k
    chosen = sorted(smallest(order_keys(key, stream, slots), range(slots), k))
    return [s + i * (span_len - 1) for i, s in enumerate(chosen)]


def del_word(tokens, key, stream, ws, del_id, rate, fixed=frozenset()):
    words = split_words(tokens, ws, fixed)
    m = movable(words, fixed)
    k = min(rhu(rate * len(m)), max(content(words, fixed, del_id) - 1, 0))
    dead = set(smallest(order_keys(key, stream, len(words)), m, k))
    return with_dels(words, dead, del_id)


def del_span(tokens, key, stream, ws, del_id, num, frac, fixed=frozenset()):
    words = split_words(tokens, ws, fixed)
    m = movable(words, fixed)
    span_len, k = plan(len(m), num, frac)
    k = min(k, max(content(words, fixed, del_id) - 1, 0) // span_len)
    dead = {m[s + j] for s in place(key, stream, len(m), k, span_len) for j in range(span_len)}
    return with_dels(words, dead, del_id)


def reorder(tokens, key, stream, ws, pairs, frac, fixed=frozenset()):
    words = split_words(tokens, ws, fixed)
    m = movable(words, fixed)
    span_len, k = plan(len(m), pairs, frac, group=2)
    if k == 0:
        return list(tokens)
    starts = place(key, stream, len(m), 2 * k, span_len)
    pk = order_keys(key, stream + 1, 2 * k)
    perm = sorted(range(2 * k), key=lambda i: pk[i])
    order = list(range(len(m)))  # in movable words
    for p in range(k):
        a, b = starts[perm[2 * p]], starts[perm[2 * p + 1]]
        order[a:a + span_len], order[b:b + span_len] = order[b:b + span_len], order[a:a + span_len]
    source = list(range(len(words)))
    for i, j in enumerate(order):
        source[m[i]] = m[j]
    return [t for w in source for t in words[w]]


def subs(tokens, key, stream, ws, rate, mapping, fixed=frozenset()):
    words = split_words(tokens, ws, fixed)
    m = movable(words, fixed)
    options = [list(mapping.get(tuple(w), ())) if q in m else [] for q, w in enumerate(words)]
    candidates = [w for w in range(len(words)) if options[w]]
    k = min(len(candidates), rhu(rate * len(m)))
    picks = u(key, stream + 1, len(words))
    for w in smallest(order_keys(key, stream, len(words)), candidates, k):
        words[w] = [int(t) for t in options[w][math.floor(picks[w] * len(options[w]))]]
    return [t for w in words for t in w]


def augment(tokens, key, methods, cfg, ws, del_id, mapping=None, drop_deleted=False, fixed=frozenset()):
    """One view of one row: methods in order, method m drawing from streams 4m..; ``fixed`` tokens stay put."""
    tokens = [int(t) for t in tokens]
    for m, method in enumerate(methods):
        s = 4 * m
        if method == "del-word":
            tokens = del_word(tokens, key, s, ws, del_id, cfg.del_word_rate, fixed)
        elif method == "del-span":
            tokens = del_span(tokens, key, s, ws, del_id, cfg.del_span_num, cfg.del_span_frac, fixed)
        elif method == "reorder":
            tokens = reorder(tokens, key, s, ws, cfg.reorder_pairs, cfg.reorder_frac, fixed)
        elif method == "subs":
            tokens = subs(tokens, key, s, ws, cfg.subs_rate, mapping, fixed)
    tokens = merge(tokens, del_id)
    return [t for t in tokens if t != del_id] if drop_deleted else tokens


def mask(seq, key, cfg, special_ids, mask_id, vocab_size):
    """mask_batch's rule for one row: (input ids, labels)."""
    seq = [int(t) for t in seq]
    specials = set(special_ids)
    candidates = [j for j, t in enumerate(seq) if t not in specials]
    count = math.floor(cfg.prob * len(candidates) + u(key, 0, 1)[0])
    chosen = smallest(order_keys(key, 1, len(seq)), candidates, count)
    action, rand = u(key, 2, len(seq)), u(key, 3, len(seq))
    allowed = [t for t in range(vocab_size) if t not in specials]
    inp, labels = list(seq), [-100] * len(seq)
    for j in chosen:
        labels[j] = seq[j]
        if action[j] < cfg.mask_frac:
            inp[j] = mask_id
        elif action[j] < cfg.mask_frac + cfg.random_frac:
            inp[j] = allowed[min(math.floor(rand[j] * len(allowed)), len(allowed) - 1)]
    return inp, labels


def _word_bounds(seq: list[int], word_start, specials) -> tuple[list[int], list[int]]:
    """First token and end of every word (a word-start token and the continuation tokens after it; a special token
    is a word by itself)."""
    starts = [j for j, t in enumerate(seq) if j == 0 or word_start[t] or t in specials or seq[j - 1] in specials]
    return starts, starts[1:] + [len(seq)]


def _replace(seq, chosen: dict[int, int], key, cfg, specials, mask_id, vocab_size):
    """80/10/10 for the chosen positions; ``chosen[j]`` is the position whose action draw decides for j."""
    action, rand = u(key, 2, len(seq)), u(key, 3, len(seq))
    allowed = [t for t in range(vocab_size) if t not in specials]
    inp, labels = list(seq), [-100] * len(seq)
    for j, by in chosen.items():
        labels[j] = seq[j]
        if action[by] < cfg.mask_frac:
            inp[j] = mask_id
        elif action[by] < cfg.mask_frac + cfg.random_frac:
            inp[j] = allowed[min(math.floor(rand[j] * len(allowed)), len(allowed) - 1)]
    return inp, labels


def mask_whole_words(seq, key, cfg, special_ids, mask_id, vocab_size, word_start):
    """scheme=whole_word for one row: floor(prob * words + u) candidate words by smallest key, all their tokens."""
    seq = [int(t) for t in seq]
    specials = set(special_ids)
    starts, ends = _word_bounds(seq, word_start, specials)
    cand = [q for q, s in enumerate(starts) if seq[s] not in specials]
    count = math.floor(cfg.prob * len(cand) + u(key, 0, 1)[0])
    keys = order_keys(key, 1, len(seq))
    picked = sorted(cand, key=lambda q: keys[starts[q]])[:count]
    chosen = {j: j for q in picked for j in range(starts[q], ends[q]) if seq[j] not in specials}
    return _replace(seq, chosen, key, cfg, specials, mask_id, vocab_size)


def truncated_geometric(x: float, p: float, max_len: int) -> int:
    """Inverse CDF by table: the smallest k in 1..max_len with x < P(L <= k), L ~ Geometric(p) given L <= max_len."""
    pmf = [p * (1 - p) ** (k - 1) for k in range(1, max_len + 1)]
    total, acc = sum(pmf), 0.0
    for k, m in enumerate(pmf, start=1):
        acc += m / total
        if x < acc:
            return k
    return max_len


def mask_spans(seq, key, cfg, special_ids, mask_id, vocab_size, word_start):
    """scheme=span for one row: anchor words by smallest key; each covers its word and the next length - 1 words
    (maskable tokens not yet chosen), token by token, until K tokens are chosen."""
    seq = [int(t) for t in seq]
    specials = set(special_ids)
    starts, ends = _word_bounds(seq, word_start, specials)
    cand = [q for q, s in enumerate(starts) if seq[s] not in specials]
    budget = math.floor(cfg.prob * sum(t not in specials for t in seq) + u(key, 0, 1)[0])
    keys = order_keys(key, 1, len(seq))
    length_draw = u(key, 4, len(seq))
    chosen: dict[int, int] = {}
    for q in sorted(cand, key=lambda q: keys[starts[q]]):
        if len(chosen) >= budget:
            break
        last = min(q + truncated_geometric(length_draw[starts[q]], cfg.span_p, cfg.span_max), len(starts)) - 1
        for j in range(starts[q], ends[last]):
            if len(chosen) >= budget:
                break
            if seq[j] not in specials and j not in chosen:
                chosen[j] = starts[q]
    return _replace(seq, chosen, key, cfg, specials, mask_id, vocab_size)
