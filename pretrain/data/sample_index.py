"""The sample index and its caches: which sentences make each sample, built once per dataset and shared.

Shape legend: N = samples, S = sentences.

Greedy packing (``build_sample_index``, in C when the helper is built) turns a source's sentence sizes and
document boundaries into samples — within one document (``data.packing=document``), or across documents with a
separator token at each boundary (``full``: RoBERTa's FULL-SENTENCES; ``separators`` says where they go); the result is cached as ``<dataset>/index-cache/samples-...npy`` (the N + 1
sample starts, ``SampleIndex``) and the sentence stage's non-empty sentences as ``sentences-...npy``
(``SentenceIndex``). Both are written once in a pass over the shards' memory-mapped sizes into a sparse file
(no corpus-sized array in RAM), published by one rename, checked cheaply when opened (a damaged or foreign cache
is rebuilt, never used), memory-mapped by every rank and sent to DataLoader workers as their path.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from pretrain.data.shards import INDEX_CACHE_DIR, CorruptShardError
from pretrain.distributed.env import unique_suffix

PACKINGS = ("document", "full")


def build_sample_index(sizes: np.ndarray, doc_idx: np.ndarray, budget: int,
                       full: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Greedy packing: (first_sentence_N, end_sentence_N) int64 of each sample, end exclusive.

    Sentences are added to the current sample while the token total stays <= budget; empty sentences never
    start a sample. Samples never cross a document boundary, or, with ``full``, run on across them, each
    boundary between two non-empty sentences of a sample counting one separator token in the budget.
    Runs in the C helper ``pretrain.data._index`` (csrc/cpu/sample_index.c) when it is built, else in
    ``build_sample_index_py`` (the same rule, ~10x slower).
    """
    _index = _helper(full)
    if _index is None:
        return build_sample_index_py(sizes, doc_idx, budget, full)
    first, end = _index.pack(*_packer_inputs(sizes, doc_idx), int(budget), *([True] if full else []))
    return np.frombuffer(first, dtype=np.int64), np.frombuffer(end, dtype=np.int64)


def _helper(full: bool):
    """The C helper, or None when it is not built (or, for ``full``, built from sources older than it: rebuild
    with ``pip install -e .`` or ``python setup.py build_ext --inplace``)."""
    try:
        from pretrain.data import _index
    except ImportError:
        return None
    if full and "full" not in (_index.pack.__doc__ or ""):
        return None
    return _index


def _packer_inputs(sizes, doc_idx) -> tuple[np.ndarray, np.ndarray]:
    """sizes (int32 or int64) and doc_idx (int64) as the C helper reads them: contiguous, no copy when they are."""
    sizes = np.asarray(sizes)
    if sizes.dtype not in (np.int32, np.int64):
        sizes = sizes.astype(np.int64)
    return np.ascontiguousarray(sizes), np.ascontiguousarray(doc_idx, dtype=np.int64)


def build_sample_index_py(sizes: np.ndarray, doc_idx: np.ndarray, budget: int,
                          full: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """``build_sample_index`` in pure Python (the fallback, and the reference its C helper is tested against)."""
    sizes_l = np.asarray(sizes, dtype=np.int64).tolist()
    doc_l = np.asarray(doc_idx, dtype=np.int64).tolist()
    firsts: list[int] = []
    ends: list[int] = []
    first, used = -1, 0
    for d in range(len(doc_l) - 1):
        if not full:
            used = 0
        sep = 1 if used else 0  # full: a non-empty sentence of this document after others costs a separator
        for i in range(doc_l[d], doc_l[d + 1]):
            n = sizes_l[i]
            if n == 0:
                continue
            if used and used + sep + n > budget:
                firsts.append(first)
                ends.append(i)
                used, sep = 0, 0
            if not used:
                first = i
            used += sep + n
            sep = 0
        if used and (not full or d == len(doc_l) - 2):
            firsts.append(first)
            ends.append(doc_l[d + 1])
    return np.asarray(firsts, dtype=np.int64), np.asarray(ends, dtype=np.int64)


INDEX_RULE = "greedy1"
"""Name of the packing rule in cache file names: change it when build_sample_index's output changes."""
INDEX_RULES = {"document": INDEX_RULE, "full": "full1"}
"""The rule name of each ``data.packing``."""


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
        """(first_B, end_B) int64: the sentence range of each sample in ``index_B`` (end exclusive). A cache
        damaged inside (opening checks its ends only) is caught here, before a batch reads it."""
        index_B = np.asarray(index_B, dtype=np.int64)
        first_B, next_B = np.asarray(self.starts[index_B]), np.asarray(self.starts[index_B + 1])
        bad_B = (first_B < 0) | (next_B <= first_B) | (next_B > self.bounds[-1])
        if bad_B.any():
            self._damaged(int(index_B[bad_B][0]))
        shard_B = np.searchsorted(self.bounds, first_B, side="right") - 1
        return first_B, np.minimum(next_B, self.bounds[np.minimum(shard_B + 1, len(self.bounds) - 1)])

    def range(self, index: int) -> tuple[int, int]:
        first, end = self.ranges(np.array([index]))
        return int(first[0]), int(end[0])

    def _damaged(self, k: int) -> None:
        """DamagedIndexError naming sample ``k``, whose starts do not make a range of the source's sentences."""
        what = f"the sample index cache {self.path}" if self.path is not None else "the sample index"
        raise DamagedIndexError(
            f"{what} is damaged: sample {k} covers sentences {int(self.starts[k])} to {int(self.starts[k + 1])}, "
            f"not a range within the source's {int(self.bounds[-1])} sentences (a flipped bit, a bad copy). Delete "
            f"{self.path or 'it'} and relaunch: it is rebuilt from the dataset.")


class DamagedIndexError(CorruptShardError):
    """A sample index cache that does not fit its dataset, found when a batch reads it (re-raised from a DataLoader
    worker with its own message only, as CorruptShardError)."""


def index_cache_path(source, budget: int, packing: str = "document") -> Path | None:
    """<dataset>/index-cache/samples-<manifest sha256>-b<budget>-<rule>-<layout>.npy for a ShardedDataset; None
    otherwise (the rule names the packing: greedy1 within documents, full1 across them).

    The key names exactly what the index depends on: the dataset (its manifest, which checksums every
    shard), the token budget (max_len - 2), the packing rule and the file layout; a cache of anything else is
    another file."""
    digest = getattr(source, "manifest_digest", None)
    if digest is None:
        return None
    rule = INDEX_RULES[packing]
    return _cache_dir(source) / f"samples-{digest}-b{budget}-{rule}-{INDEX_LAYOUT}.npy"


def _cache_dir(source) -> Path:
    """The source's index-cache directory (``data.index_cache_dir``, else ``<dataset>/index-cache``)."""
    return getattr(source, "cache_dir", None) or Path(source.directory) / INDEX_CACHE_DIR


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
    return _open_cached(path, "sample index", lambda arr: len(arr) == 1 or (
        len(arr) > 1 and 0 <= int(arr[0]) < int(arr[1]) and int(arr[-2]) < int(arr[-1]) <= num_sentences))


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
    tmp = path.with_name(f".{path.name}.tmp-{unique_suffix()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except OSError as e:
        print(f"[data] could not cache the {what} in {path.parent} ({e}); every rank builds it in memory (8 bytes "
              f"a row): set data.index_cache_dir to a writable directory that all ranks see", flush=True)
        tmp.unlink(missing_ok=True)
        return None
    return opened()


def load_or_build_sample_index(source, budget: int, packing: str = "document") -> SampleIndex:
    """The source's SampleIndex: memory-mapped from the dataset's index cache, or built and cached
    (``_cached_or_built``). A read-only dataset directory is built in memory. ``packing``: "document" (samples
    within one document) or "full" (across documents; a shard still ends a sample)."""
    if packing not in PACKINGS:
        raise ValueError(f"data.packing must be one of {PACKINGS}, got {packing!r}")
    full = packing == "full"
    path, bounds = index_cache_path(source, budget, packing), _bounds(source)
    cached = _cached_or_built(path, "sample index", lambda: _open_cached_index(path, len(source)),
                              lambda tmp: _write_index(tmp, source, budget, full))
    if cached is not None:
        return SampleIndex(cached, bounds, path)
    firsts, last = [np.zeros(0, np.int64)], 0
    for sizes, doc_idx, start in _pieces(source):
        first, end = build_sample_index(sizes, doc_idx, budget, full)
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


def _write_index(tmp: Path, source, budget: int, full: bool = False) -> None:
    """The .npy of the N + 1 starts, in one pass over the shards' sizes: sized for the worst case of one sample
    per sentence, each shard's samples packed straight into its memory map (the C helper; the Python packer's
    output is copied in without it), then cut to N + 1. No corpus-sized array is held in RAM."""
    _index = _helper(full)
    pieces = _pieces(source)

    def fill(out: np.ndarray) -> int:
        at, last = 0, 0
        for sizes, doc_idx, start in pieces:
            if _index is not None:
                n, end = _index.starts(*_packer_inputs(sizes, doc_idx), budget, out[at:at + len(sizes)], start,
                                       *([True] if full else []))
            else:
                first, ends = build_sample_index(sizes, doc_idx, budget, full)
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
    path = (_cache_dir(source) / f"sentences-{digest}-{NONEMPTY_RULE}.npy"
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
    # In RAM on every rank (8 bytes a non-empty sentence): counted first, so the peak is that one array, not a
    # worst-case array plus its trimmed copy (16 GB a rank at 1e9 sentences).
    count = sum(int(np.count_nonzero(np.asarray(sizes[a:a + _SCAN]) > 0))
                for sizes, _, _ in _pieces(source) for a in range(0, len(sizes), _SCAN))
    out = np.empty(count, dtype=np.int64)
    fill(out)
    return SentenceIndex(out)


def separators(source, first_B: np.ndarray, end_B: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(rows_K, pos_K): where packing "full" puts a separator in samples of sentences ``first_B .. end_B - 1``
    (each inside one shard): before the first token of every document that starts inside the range, as a token
    position from the range's first token; one per position (documents of empty sentences between two others
    share it) and never at 0 (a sample starts with a non-empty sentence). Past-the-end positions are left for the
    caller to drop (a document of empty sentences ending a range). Reads the shards' memory-mapped document and
    offset tables only."""
    first_B, end_B = np.asarray(first_B, dtype=np.int64), np.asarray(end_B, dtype=np.int64)
    rows, pos = [np.zeros(0, np.int64)], [np.zeros(0, np.int64)]
    for inside, doc_idx, offsets, start in _doc_tables(source, first_B):
        f, e = first_B[inside] - start, end_B[inside] - start
        lo = np.searchsorted(doc_idx, f, side="right")
        hi = np.searchsorted(doc_idx, e, side="left")
        count = np.maximum(hi - lo, 0)
        row_K = np.repeat(inside, count)
        doc_K = np.repeat(lo, count) + (np.arange(int(count.sum())) - np.repeat(np.cumsum(count) - count, count))
        base_K = np.repeat(np.asarray(offsets[f]), count)
        rows.append(row_K)
        pos.append(np.asarray(offsets[np.asarray(doc_idx[doc_K])]) - base_K)
    rows_K, pos_K = np.concatenate(rows), np.concatenate(pos)
    if not len(rows_K):
        return rows_K, pos_K
    pairs = np.unique(np.stack([rows_K, pos_K], axis=1), axis=0)
    return pairs[:, 0], pairs[:, 1]


def _doc_tables(source, first_B: np.ndarray) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, int]]:
    """(rows of ``first_B`` in it, doc_idx, token offset of each sentence, first sentence) for each shard of a
    ShardedDataset that holds some of ``first_B`` (found by one search: a batch's cost does not grow with the
    hundreds of shards of a large corpus), else for the whole source (offsets computed from its sizes: small test
    sources)."""
    shards = getattr(source, "shards", None)
    if shards is None:
        sizes = np.asarray(source.sizes, dtype=np.int64)
        inside = np.flatnonzero((first_B >= 0) & (first_B < len(sizes)))
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        return [(inside, np.asarray(source.doc_idx), offsets, 0)] if len(inside) else []
    starts = np.asarray(source.starts)
    k_B = np.searchsorted(starts, first_B, side="right") - 1
    return [(np.flatnonzero(k_B == k), shards[k].doc_idx, shards[k].offsets, int(starts[k]))
            for k in np.unique(k_B).tolist() if 0 <= k < len(shards)]


def _pieces(source) -> list[tuple[np.ndarray, np.ndarray, int]]:
    """(sizes, doc_idx, first sentence) per shard of a ShardedDataset (documents never cross shards), else the
    whole source: only the shards' memory-mapped sizes are read, no corpus-sized copy."""
    shards = getattr(source, "shards", None)
    if shards is None:
        return [(source.sizes, source.doc_idx, 0)]
    return [(shard.sizes, shard.doc_idx, start) for shard, start in zip(shards, source.starts.tolist())]
