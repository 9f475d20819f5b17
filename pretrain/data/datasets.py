"""Training samples: an MLM sequence plus two CLEAR views of the same text, and source blending.

Shape legend: T = MLM sequence length (<= max_len), Ta/Tb = view lengths (<= view_max_len),
N = samples, D = documents.

A sample is a run of contiguous sentences of one document whose tokens fit in
``max_len - 2`` (a single longer sentence is truncated). Its noise comes from counter-based draws keyed
by ``(seed, epoch, index)`` (``counter_rng``), in separate streams for the masking and each view, so a sample
depends only on its key, never on the batch it is built in or the worker that builds it.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch

from pretrain.config.data import DataConfig
from pretrain.data.augment import build_augmenter
from pretrain.data.counter_rng import derive, sample_keys
from pretrain.data.masking import mask_batch, special_table
from pretrain.data.ragged import Ragged
from pretrain.data.shards import INDEX_CACHE_DIR, ShardedDataset


def build_sample_index(sizes: np.ndarray, doc_idx: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy packing: (first_sentence_N, end_sentence_N) int64 of each sample, end exclusive.

    Sentences are added to the current sample while the token total stays <= budget;
    samples never cross a document boundary; empty sentences never start a sample.
    Runs in the C helper ``pretrain.data._index`` (csrc/cpu/sample_index.c) when it is built, else in
    ``build_sample_index_py`` (the same rule, ~10x slower).
    """
    try:
        from pretrain.data import _index
    except ImportError:
        return build_sample_index_py(sizes, doc_idx, budget)
    first, end = _index.pack(*_packer_inputs(sizes, doc_idx), int(budget))
    return np.frombuffer(first, dtype=np.int64), np.frombuffer(end, dtype=np.int64)


def _packer_inputs(sizes, doc_idx) -> tuple[np.ndarray, np.ndarray]:
    """sizes (int32 or int64) and doc_idx (int64) as the C helper reads them: contiguous, no copy when they are."""
    sizes = np.asarray(sizes)
    if sizes.dtype not in (np.int32, np.int64):
        sizes = sizes.astype(np.int64)
    return np.ascontiguousarray(sizes), np.ascontiguousarray(doc_idx, dtype=np.int64)


def build_sample_index_py(sizes: np.ndarray, doc_idx: np.ndarray, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """``build_sample_index`` in pure Python (the fallback, and the reference its C helper is tested against)."""
    sizes_l = np.asarray(sizes, dtype=np.int64).tolist()
    doc_l = np.asarray(doc_idx, dtype=np.int64).tolist()
    firsts: list[int] = []
    ends: list[int] = []
    for d in range(len(doc_l) - 1):
        first, used = -1, 0
        for i in range(doc_l[d], doc_l[d + 1]):
            n = sizes_l[i]
            if n == 0:
                continue
            if used and used + n > budget:
                firsts.append(first)
                ends.append(i)
                used = 0
            if not used:
                first = i
            used += n
        if used:
            firsts.append(first)
            ends.append(doc_l[d + 1])
    return np.asarray(firsts, dtype=np.int64), np.asarray(ends, dtype=np.int64)


INDEX_RULE = "greedy1"
"""Name of the packing rule in cache file names: change it when build_sample_index's output changes."""


INDEX_LAYOUT = "starts"
"""Layout of the cache file (in its name): a 1-D int64 .npy of the N + 1 sample starts (see SampleIndex)."""
_HEADER_BYTES = 128
"""The cache's .npy header, padded to a fixed size so that it can be rewritten in place once N is known."""


class _MappedByPath:
    """An index whose array (attribute ``_array``) is memory-mapped from ``path`` when it has one: pickling (to
    DataLoader workers) sends the path only, and the receiver maps the file again."""

    _array = ""
    path: Path | None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        if self.path is not None:
            state[self._array] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if getattr(self, self._array) is None:
            setattr(self, self._array, np.load(self.path, mmap_mode="r", allow_pickle=False))


class SampleIndex(_MappedByPath):
    """The samples of a source as N + 1 sentence starts: sample k is sentences ``starts[k] ..
    min(starts[k + 1], end of the shard holding starts[k]) - 1``, and ``starts[N]`` ends the last sample.

    The greedy packer's end of a sample is the next sample's first sentence except across empty sentences it
    skipped (a document's leading ones), which hold no tokens: both ranges give the same tokens, so half of
    the (first, end) pairs is enough. A range never runs past its shard (``bounds``, the shards' first
    sentences and the total), as the shards' token gather requires. Memory-mapped from the cache file when
    there is one (pickled as its path)."""

    _array = "starts"

    def __init__(self, starts: np.ndarray, bounds: np.ndarray, path: Path | None = None):
        self.starts, self.bounds, self.path = starts, np.asarray(bounds, dtype=np.int64), path

    def __len__(self) -> int:
        return len(self.starts) - 1

    def ranges(self, index_B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(first_B, end_B) int64: the sentence range of each sample in ``index_B`` (end exclusive)."""
        index_B = np.asarray(index_B, dtype=np.int64)
        first_B, next_B = np.asarray(self.starts[index_B]), np.asarray(self.starts[index_B + 1])
        shard_B = np.searchsorted(self.bounds, first_B, side="right") - 1
        return first_B, np.minimum(next_B, self.bounds[np.minimum(shard_B + 1, len(self.bounds) - 1)])

    def range(self, index: int) -> tuple[int, int]:
        first, end = self.ranges(np.array([index]))
        return int(first[0]), int(end[0])



def index_cache_path(source, budget: int) -> Path | None:
    """<dataset>/index-cache/samples-<manifest sha256>-b<budget>-<rule>-<layout>.npy for a ShardedDataset; None
    otherwise.

    The key names exactly what the index depends on: the dataset (its manifest, which checksums every
    shard), the token budget (max_len - 2), the packing rule and the file layout; a cache of anything else is
    another file."""
    digest = getattr(source, "manifest_digest", None)
    if digest is None:
        return None
    return Path(source.directory) / INDEX_CACHE_DIR / f"samples-{digest}-b{budget}-{INDEX_RULE}-{INDEX_LAYOUT}.npy"


def _bounds(source) -> np.ndarray:
    """The shards' first sentences and the total (one shard: [0, len])."""
    starts = getattr(source, "starts", None)
    return np.asarray(starts if starts is not None else [0, len(source)], dtype=np.int64)


def _open_cached(path: Path, what: str, check) -> np.ndarray | None:
    """A cached int64 .npy, memory-mapped; None when absent or damaged (a damaged one is never used). ``check``
    looks at the array cheaply (its ends: a full scan would cost seconds at 1e9 sentences)."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as e:  # truncated or not an .npy: rebuild
        print(f"[data] {what} cache {path} is damaged ({e}); rebuilding it", flush=True)
        return None
    if not (arr.ndim == 1 and arr.dtype == np.int64 and check(arr)):
        print(f"[data] {what} cache {path} does not fit its dataset; rebuilding it", flush=True)
        return None
    return arr


def _open_cached_index(path: Path, num_sentences: int) -> np.ndarray | None:
    """The cached starts (N + 1), memory-mapped; None when absent or damaged."""
    return _open_cached(path, "sample index", lambda arr: len(arr) == 1 or len(arr) > 1 and (
        0 <= int(arr[0]) < int(arr[1]) and int(arr[-2]) < int(arr[-1]) <= num_sentences))


def _cached_or_built(path: Path | None, what: str, opened, write) -> np.ndarray | None:
    """``opened()`` (the memory-mapped cache at ``path``) or, when it is absent or damaged, ``write(tmp)`` into a
    temporary file renamed to ``path`` (atomic: a file appears complete under its name or not at all; concurrent
    builders write identical bytes and the last rename wins), then opened; None when there is no cache path or
    it cannot be written (a read-only or full dataset directory: the caller builds in memory)."""
    if path is None:
        return None
    cached = opened()
    if cached is not None:
        return cached
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        print(f"[data] could not cache the {what} in {path.parent} ({e}); using it from memory", flush=True)
        tmp.unlink(missing_ok=True)
        return None
    return opened()


def load_or_build_sample_index(source, budget: int) -> SampleIndex:
    """The source's SampleIndex: memory-mapped from the dataset's index cache, or built and cached
    (``_cached_or_built``). A read-only dataset directory is built in memory."""
    path, bounds = index_cache_path(source, budget), _bounds(source)
    cached = _cached_or_built(path, "sample index", lambda: _open_cached_index(path, len(source)),
                              lambda tmp: _write_index(tmp, source, budget))
    if cached is not None:
        return SampleIndex(cached, bounds, path)
    firsts, last = [np.zeros(0, np.int64)], 0
    for sizes, doc_idx, start in _pieces(source):
        first, end = build_sample_index(sizes, doc_idx, budget)
        if len(first):
            firsts.append(first + start)
            last = int(end[-1]) + start
    return SampleIndex(np.concatenate(firsts + [np.array([last], np.int64)]), bounds)


def _npy_header(length: int) -> bytes:
    """A version-1.0 .npy header of a 1-D little-endian int64 array, padded to _HEADER_BYTES."""
    body = ("{'descr': '<i8', 'fortran_order': False, 'shape': (%d,), }" % length).encode("latin1")
    return b"\x93NUMPY\x01\x00" + (_HEADER_BYTES - 10).to_bytes(2, "little") + body.ljust(_HEADER_BYTES - 11) + b"\n"


def _write_int64_npy(tmp: Path, worst: int, fill) -> None:
    """An int64 .npy of at most ``worst`` values without holding them in RAM: the file is sized (sparse) for
    ``worst``, ``fill(out)`` writes into its memory map and returns how many it wrote, then the file is cut to
    that, its header rewritten and fsynced."""
    with open(tmp, "wb") as fh:
        fh.write(_npy_header(worst))
        fh.truncate(_HEADER_BYTES + 8 * worst)
    out = np.memmap(tmp, dtype=np.int64, mode="r+", offset=_HEADER_BYTES, shape=(worst,)) if worst else None
    count = fill(out) if worst else 0
    if out is not None:
        out.flush()
        del out
    with open(tmp, "rb+") as fh:
        fh.write(_npy_header(count))
        fh.truncate(_HEADER_BYTES + 8 * count)
        os.fsync(fh.fileno())


def _write_index(tmp: Path, source, budget: int) -> None:
    """The .npy of the N + 1 starts, in one pass over the shards' sizes: sized for the worst case of one sample
    per sentence, each shard's samples packed straight into its memory map (the C helper; the Python packer's
    output is copied in without it), then cut to N + 1. No corpus-sized array is held in RAM."""
    try:
        from pretrain.data import _index
    except ImportError:
        _index = None
    pieces = _pieces(source)

    def fill(out: np.ndarray) -> int:
        at, last = 0, 0
        for sizes, doc_idx, start in pieces:
            if _index is not None:
                n, end = _index.starts(*_packer_inputs(sizes, doc_idx), budget, out[at:at + len(sizes)], start)
            else:
                first, ends = build_sample_index(sizes, doc_idx, budget)
                n, end = len(first), (int(ends[-1]) + start if len(first) else start)
                np.add(first, start, out=out[at:at + n])
            if n:
                last = end
            at += n
        out[at] = last
        return at + 1

    _write_int64_npy(tmp, sum(len(sizes) for sizes, _, _ in pieces) + 1, fill)


NONEMPTY_RULE = "nonempty-v1"
_SCAN = 1 << 22  # sentences whose sizes are compared per numpy call (32 MiB of positions at most)


class SentenceIndex(_MappedByPath):
    """The non-empty sentences of a source, in order (int64 positions; the sentence stage's samples), memory-mapped
    from ``<dataset>/index-cache/sentences-<manifest sha256>-nonempty-v1.npy`` when the dataset has a manifest.
    Pickled as its path when it has one."""

    _array = "positions"

    def __init__(self, positions: np.ndarray, path: Path | None = None):
        self.positions, self.path = positions, path

    def __len__(self) -> int:
        return len(self.positions)

    def __getitem__(self, index):
        return self.positions[index]



def load_or_build_sentence_index(source) -> SentenceIndex:
    """The source's non-empty sentences, cached like the sample index (built once in a pass over the shards'
    memory-mapped sizes, in slices: no corpus-sized array in RAM; a damaged or foreign cache is rebuilt)."""
    digest, total = getattr(source, "manifest_digest", None), len(source)
    path = (Path(source.directory) / INDEX_CACHE_DIR / f"sentences-{digest}-{NONEMPTY_RULE}.npy"
            if digest is not None else None)

    def fill(out: np.ndarray) -> int:
        at = 0
        for sizes, _, start in _pieces(source):
            for a in range(0, len(sizes), _SCAN):
                rows = np.flatnonzero(np.asarray(sizes[a:a + _SCAN]) > 0)
                np.add(rows, start + a, out=out[at:at + len(rows)])
                at += len(rows)
        return at

    def opened():
        return _open_cached(path, "sentence index", lambda arr: len(arr) == 0 or (
            0 <= int(arr[0]) and int(arr[-1]) < total and (len(arr) == 1 or int(arr[-2]) < int(arr[-1]))))

    cached = _cached_or_built(path, "sentence index", opened, lambda tmp: _write_int64_npy(tmp, total, fill))
    if cached is not None:
        return SentenceIndex(cached, path)
    out = np.empty(total, dtype=np.int64)
    return SentenceIndex(out[:fill(out)].copy())


def _pieces(source) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """(sizes, doc_idx, first sentence) per shard of a ShardedDataset (documents never cross shards), else the
    whole source: only the shards' memory-mapped sizes are read, no corpus-sized copy."""
    shards = getattr(source, "shards", None)
    if shards is None:
        return [(source.sizes, source.doc_idx, 0)]
    return [(shard.sizes, shard.doc_idx, start) for shard, start in zip(shards, source.starts.tolist())]


def parse_key(key) -> tuple[int, int]:
    """(epoch, index) from a key tuple, or (0, index) from a bare int."""
    if isinstance(key, (tuple, list)):
        epoch, index = key
        return int(epoch), int(index)
    return 0, int(key)


VIEW_A, VIEW_B = 1, 2
"""``counter_rng.derive`` tags of the two views' keys (the masking draws from the sample's own key)."""
SAMPLE_STREAM = "counter-v2"
"""Names the rule mapping (seed, epoch, index) to a sample's noise; checkpoints record it, and a run is not
resumed into another one (v1: numpy Generator per sample; v2: counter_rng draws, batched)."""


class PretrainDataset(torch.utils.data.Dataset):
    """Samples of one source (a ShardedDataset-like object: sizes, doc_idx, __getitem__, optionally tokens).

    ``__getitems__(keys)`` builds a whole micro-batch at once (vectorised; what the DataLoader calls), a
    ``SampleBatch``; ``dataset[key]`` is one sample of it as a dict of arrays."""

    sample_stream = SAMPLE_STREAM

    def __init__(self, source, tokenizer, cfg: DataConfig, *, seed: int, with_views: bool = True):
        self.source = source
        self.cfg = cfg
        self.seed = int(seed)
        self.with_views = with_views
        self.vocab_size = tokenizer.vocab_size
        self.special_ids = tuple(sorted(tokenizer.special_ids))
        self.special_V, self.allowed_A = special_table(self.vocab_size, self.special_ids)
        self.cls_id, self.sep_id, self.mask_id = tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id
        self.augmenter = build_augmenter(cfg.augment, tokenizer) if with_views else None
        self.index = load_or_build_sample_index(source, cfg.max_len - 2)

    def __len__(self) -> int:
        return len(self.index)

    def text(self, index: int) -> np.ndarray:
        """Token ids (no specials) of sample ``index``, at most max_len - 2 of them, sentence by sentence (a
        source without ``token_batch``)."""
        first, end = self.index.range(index)
        return np.concatenate([np.asarray(self.source[i]) for i in range(first, end)])[:self.cfg.max_len - 2]

    def texts(self, index_B: np.ndarray) -> Ragged:
        """``text`` of many samples, gathered at once from a ShardedDataset (one sample at a time otherwise)."""
        if not hasattr(self.source, "token_batch"):
            return Ragged.from_rows([self.text(i) for i in index_B.tolist()])
        first_B, end_B = self.index.ranges(index_B)
        return Ragged(*self.source.token_batch(first_B, end_B, self.cfg.max_len - 2))

    def __getitems__(self, keys) -> "SampleBatch":
        """The samples of ``keys`` ((epoch, index) pairs; index >= len reuses the text of index % len with
        fresh noise), built together. Each row depends only on its key."""
        n = len(self)
        epoch_B, index_B = np.array([parse_key(k) for k in keys], dtype=np.int64).reshape(-1, 2).T
        if n == 0 or (index_B < 0).any():
            raise IndexError(f"sample index {index_B.min(initial=0)} out of range for a dataset of {n} samples")
        keys_B = sample_keys(self.seed, epoch_B, index_B)
        text = self.texts(index_B % n)
        seq = text.wrap(self.cls_id, self.sep_id)
        input_BT, labels_BT = mask_batch(seq, keys_B, self.cfg.masking, special_V=self.special_V,
                                         allowed_A=self.allowed_A, mask_id=self.mask_id)
        fields = {"input_ids": Ragged(input_BT, seq.len), "mlm_labels": Ragged(labels_BT, seq.len)}
        if self.augmenter is not None:  # both views in one call: rows 0..B-1 are view a, B..2B-1 view b
            B = len(keys_B)
            both = Ragged(np.concatenate([text.ids, text.ids]), np.concatenate([text.len, text.len]))
            views = self.augmenter(both, np.concatenate([derive(keys_B, VIEW_A), derive(keys_B, VIEW_B)]))
            budget = self.cfg.view_max_len - 2
            for name, rows in (("view_a", slice(0, B)), ("view_b", slice(B, 2 * B))):
                len_B = np.minimum(views.len[rows], budget)
                view = Ragged(views.ids[rows, : int(len_B.max(initial=0))], len_B)
                fields[name] = view.wrap(self.cls_id, self.sep_id)
        return SampleBatch(fields)

    def __getitem__(self, key) -> dict:
        """key = (epoch, index): one sample as a dict of int64 arrays (input_ids, mlm_labels, view_a, view_b)."""
        return self.__getitems__([key]).sample(0)


class SampleBatch:
    """A micro-batch of samples: named ``Ragged`` fields (+ ``source``, int64 [B], for a blend)."""

    def __init__(self, fields: dict[str, Ragged], source: np.ndarray | None = None):
        self.fields, self.source = fields, source

    def __len__(self) -> int:
        return len(next(iter(self.fields.values())).len)

    def __getitem__(self, rows: slice) -> "SampleBatch":
        """Rows ``rows`` as a batch of their own (each field cut to its longest row there)."""
        fields = {}
        for name, r in self.fields.items():
            len_B = r.len[rows]
            fields[name] = Ragged(r.ids[rows, : int(len_B.max(initial=0))], len_B)
        return SampleBatch(fields, None if self.source is None else self.source[rows])

    def sample(self, b: int) -> dict:
        out = {name: r.ids[b, : r.len[b]].copy() for name, r in self.fields.items()}
        if self.source is not None:
            out["source"] = int(self.source[b])
        return out

    @staticmethod
    def merge(parts: list["SampleBatch"], rows: list[np.ndarray], source: np.ndarray) -> "SampleBatch":
        """One batch whose rows ``rows[i]`` come from ``parts[i]`` (in that part's order)."""
        B = sum(len(r) for r in rows)
        fields = {}
        for name in parts[0].fields:
            width = max(p.fields[name].ids.shape[1] for p in parts)
            ids = np.zeros((B, width), dtype=np.int64)
            len_B = np.zeros(B, dtype=np.int64)
            for p, r in zip(parts, rows):
                f = p.fields[name]
                ids[r, : f.ids.shape[1]] = f.ids
                len_B[r] = f.len
            fields[name] = Ragged(ids, len_B)
        return SampleBatch(fields, source)


def apportion(total: int, weights: list[float]) -> np.ndarray:
    """Split ``total`` into integer counts proportional to weights (largest remainder), int64[S]."""
    w_S = np.asarray(weights, dtype=np.float64)
    quota_S = total * w_S / w_S.sum()
    counts_S = np.floor(quota_S).astype(np.int64)
    leftover = total - int(counts_S.sum())
    order = np.argsort(-(quota_S - counts_S), kind="stable")
    counts_S[order[:leftover]] += 1
    return counts_S


class BlendedDataset(torch.utils.data.Dataset):
    """Several sources interleaved by weight; len = total samples of all sources.

    Source s gets ``apportion(len, weights)[s]`` slots per epoch, spread evenly (slot c of
    source s sits at time (c + 0.5) / count_s; a stable sort merges them: ties go to the lower source). Within
    a source the window of samples rotates by one epoch's count each epoch, from a seed-chosen offset, so a
    down-weighted source still cycles through all its samples over epochs.

    The merged order is computed where it is read (``slots``: a binary search per source over exact integer
    comparisons of the times), never materialised: at 1e9 sentences it would be ~2 GB on every rank."""

    def __init__(self, datasets: list, weights: list[float], *, seed: int):
        if not datasets or len(datasets) != len(weights):
            raise ValueError(f"BlendedDataset needs one weight per dataset, got {len(datasets)} and {len(weights)}")
        if any(w <= 0 for w in weights):
            raise ValueError(f"data.sources weights must be > 0, got {weights}")
        sizes = [len(d) for d in datasets]
        if any(n == 0 for n in sizes):
            raise ValueError(f"a blended source has no samples (sizes {sizes}); check the dataset directories")
        if sum(sizes) >= 2**31:
            raise ValueError(f"a blend of {sum(sizes)} samples is over the 2**31 this blend's exact integer "
                             f"arithmetic allows; split the corpus into several runs' data or fewer samples")
        self.datasets = datasets
        self.weights = [float(w) for w in weights]
        self.counts_S = apportion(sum(sizes), weights)
        self.offset_S = np.array(
            [np.random.default_rng([seed, s]).integers(n) for s, n in enumerate(sizes)], dtype=np.int64
        )

    def __len__(self) -> int:
        return int(self.counts_S.sum())

    def _rank(self, s: int, c_B: np.ndarray) -> np.ndarray:
        """Position in the merged order of slot ``c_B`` of source ``s``: c plus, for every other source t, its
        slots whose time (2d + 1) / (2 n_t) is before (2c + 1) / (2 n_s) (or equal, for t < s)."""
        n_s = int(self.counts_S[s])
        rank_B = c_B.copy()
        for t, n_t in enumerate(self.counts_S.tolist()):
            if t == s or n_t == 0:
                continue
            num_B = (2 * c_B + 1) * n_t  # slot d of t is before iff (2d + 1) n_s < num (<= num for t < s)
            if t < s:
                before_B = (num_B // n_s + 1) // 2
            else:
                before_B = (-(-num_B // n_s)) // 2
            rank_B += np.clip(before_B, 0, n_t)
        return rank_B

    def slots(self, index_B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source_B, slot_B) int64 of blended positions ``index_B`` (each in [0, len))."""
        index_B = np.asarray(index_B, dtype=np.int64)
        source_B = np.full(len(index_B), -1, dtype=np.int64)
        slot_B = np.zeros(len(index_B), dtype=np.int64)
        total, S = len(self), len(self.counts_S)
        for s, n_s in enumerate(self.counts_S.tolist()):
            if n_s == 0:
                continue
            # rank(s, c) is within S of (2c + 1) N / (2 n_s) (each other source's count is within 1 of its
            # share), so a slot of s at position i is within S + 1 of i n_s / N: bisect that window only.
            guess_B = index_B * n_s // total
            lo, hi = np.clip(guess_B - S - 2, 0, n_s - 1), np.clip(guess_B + S + 3, 1, n_s)
            while (hi - lo > 1).any():  # the last slot of s in the window at or before each index
                mid = (lo + hi) // 2
                ok = self._rank(s, mid) <= index_B
                lo, hi = np.where(ok, mid, lo), np.where(ok, hi, mid)
            hit = self._rank(s, lo) == index_B
            source_B[hit], slot_B[hit] = s, lo[hit]
        if (source_B < 0).any():
            raise IndexError(f"blended positions {index_B[source_B < 0][:5].tolist()} are outside [0, {len(self)})")
        return source_B, slot_B

    def locate(self, epoch: int, index: int) -> tuple[int, int]:
        """(source, position in that source) of blended sample ``index`` in ``epoch``."""
        source, slot = self.slots(np.array([index]))
        s = int(source[0])
        return s, int(self.offset_S[s] + epoch * self.counts_S[s] + slot[0])

    @property
    def sample_stream(self) -> str:
        return self.datasets[0].sample_stream

    def __getitems__(self, keys) -> SampleBatch:
        epoch_B, index_B = np.array([parse_key(k) for k in keys], dtype=np.int64).reshape(-1, 2).T
        source_B, slot_B = self.slots(index_B)
        pos_B = self.offset_S[source_B] + epoch_B * self.counts_S[source_B] + slot_B
        parts, rows = [], []
        for s in np.unique(source_B).tolist():
            rows.append(np.flatnonzero(source_B == s))
            parts.append(self.datasets[s].__getitems__(list(zip(epoch_B[rows[-1]].tolist(),
                                                                pos_B[rows[-1]].tolist()))))
        return SampleBatch.merge(parts, rows, source_B)

    def __getitem__(self, key) -> dict:
        return self.__getitems__([key]).sample(0)


def build_dataset(cfg: DataConfig, tokenizer, *, seed: int, split: str = "train"):
    """Open cfg.sources (split='train') or cfg.valid (split='valid') as one dataset."""
    if split not in ("train", "valid"):
        raise ValueError(f"split must be 'train' or 'valid', got {split!r}")
    sources = cfg.sources if split == "train" else cfg.valid
    if not sources:
        key = "data.sources" if split == "train" else "data.valid"
        raise ValueError(f"{key} is empty; list at least one dataset directory written by pretrain-preprocess")
    sha = getattr(tokenizer, "sha256", None)  # ShardedDataset refuses data made with another tokenizer
    datasets = [PretrainDataset(ShardedDataset(s.path, tokenizer_sha256=sha), tokenizer, cfg, seed=seed)
                for s in sources]
    if len(datasets) == 1:
        return datasets[0]
    return BlendedDataset(datasets, [s.weight for s in sources], seed=seed)
