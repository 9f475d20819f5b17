"""One shard of token ids: ``<prefix>.bin`` (raw ids) + ``<prefix>.idx`` (header, offsets, docs, sizes).

The byte layout is specified in FORMAT.md next to this file. Readers memory-map both files read-only and
pickle by prefix, so DataLoader workers re-open the maps instead of copying arrays.
Legend: N = number of sequences (sentences), D = number of documents.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
import struct
from array import array
from pathlib import Path

import numpy as np

from pretrain.fsutil import file_digests

MAGIC = b"PTIDX\x00\x00\x00"
VERSION = 1
_HEADER = struct.Struct("<8sIIQQQ")  # magic, version, dtype code, N, D, num_tokens  (40 bytes)
HEADER_BYTES = _HEADER.size
DTYPE_CODES = {1: np.dtype("<u1"), 2: np.dtype("<u2"), 4: np.dtype("<i4")}
_CODE_OF = {v: k for k, v in DTYPE_CODES.items()}
SAMPLING = {"block": 1 << 16, "blocks": 4}
"""How a shard file's sampled sha256 is taken (``fsutil.file_digests``; manifest.json's ``sampled_sha256``): 4 blocks
of 64 KiB evenly spread, the last ending at the file's last byte (a zero-filled or cut end changes it): 256 KiB read
a file where a shard is opened unstamped, by every rank."""


def file_sha256(path: str) -> str:
    """sha256 of a file, read in 4 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def sampled_sha256(path: str, sampling: dict | None = None) -> str:
    """The sampled sha256 of one shard file, taken as ``sampling`` ({"block": bytes, "blocks": count}; default
    ``SAMPLING``) says."""
    sampling = sampling or SAMPLING
    return file_digests(Path(path), full=False, block=sampling["block"], blocks=sampling["blocks"])["sampled_sha256"]


def best_dtype(vocab_size: int) -> np.dtype:
    """Smallest dtype holding ids 0..vocab_size-1: uint8, uint16 or int32."""
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}")
    if vocab_size <= 1 << 8:
        return np.dtype("<u1")
    if vocab_size <= 1 << 16:
        return np.dtype("<u2")
    if vocab_size <= 2**31 - 1:
        return np.dtype("<i4")
    raise ValueError(f"vocab_size {vocab_size} does not fit in int32")


def _libc_mmap():
    """libc's mmap/munmap through ctypes (POSIX), or None (then ``map_file`` falls back to np.memmap)."""
    if os.name != "posix":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype, libc.munmap.restype = ctypes.c_void_p, ctypes.c_int
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                              ctypes.c_int64]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _libc_mmap()
_MAP_FAILED = ctypes.c_void_p(-1).value


class _FileMap:
    """A read-only shared map of a whole file that holds no file descriptor; unmapped when the last array viewing
    it is collected (it is their ``base``). np.memmap keeps one descriptor per map (Python's mmap dups it): two a
    shard, so the ~600 shards of a 3e10-token corpus took ~1200 per process, past the common soft limit of 1024."""

    def __init__(self, path: str, size: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            addr = _LIBC.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        finally:
            os.close(fd)
        if addr is None or addr == _MAP_FAILED:
            err = ctypes.get_errno()
            raise OSError(err, f"cannot memory-map {path}: {os.strerror(err)}")
        self._addr, self._size = addr, size
        self.__array_interface__ = {"shape": (size,), "typestr": "|u1", "data": (addr, True), "version": 3}

    def __del__(self) -> None:
        if _LIBC is not None and getattr(self, "_addr", None):
            _LIBC.munmap(self._addr, self._size)
            self._addr = None


def map_file(path: str) -> np.ndarray:
    """The bytes of ``path`` as a read-only uint8 array backed by a shared memory map (no copy, no descriptor
    held where libc's mmap is reachable; np.memmap elsewhere)."""
    size = os.path.getsize(path)
    if size == 0:
        return np.zeros(0, np.uint8)
    if _LIBC is None:
        return np.memmap(path, dtype=np.uint8, mode="r").view(np.ndarray)
    return np.asarray(_FileMap(path, size))


def idx_nbytes(num_sequences: int, num_documents: int) -> int:
    """Exact .idx size for N sequences and D documents."""
    return HEADER_BYTES + 8 * num_sequences + 8 * (num_documents + 1) + 4 * num_sequences


class IndexedDataset:
    """Read-only view of one shard; ``ds[i]`` is the int array of sequence ``i`` (a memmap view)."""

    def __init__(self, prefix: str, *, check: bool = True) -> None:
        """``check=False`` skips the O(N) structural scan of the index (the caller vouches that these very files
        passed it: ``ShardedDataset``'s checked stamp); the header and file-size checks always run."""
        self.prefix = str(prefix)
        idx_path, bin_path = self.prefix + ".idx", self.prefix + ".bin"
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"shard file {p} is missing; re-run pretrain-preprocess")
        idx_size = os.path.getsize(idx_path)
        if idx_size < HEADER_BYTES:
            raise ValueError(f"{idx_path} is truncated ({idx_size} bytes < {HEADER_BYTES}-byte header)")
        with open(idx_path, "rb") as f:
            magic, version, code, n, d, num_tokens = _HEADER.unpack(f.read(HEADER_BYTES))
        if magic != MAGIC:
            raise ValueError(f"{idx_path} is not a pretrain index file (bad magic {magic!r})")
        if version != VERSION:
            raise ValueError(f"{idx_path} has format version {version}; this code reads version {VERSION}")
        if code not in DTYPE_CODES:
            raise ValueError(f"{idx_path} has unknown dtype code {code}")
        if idx_size != idx_nbytes(n, d):
            raise ValueError(f"{idx_path} is truncated or corrupt: {idx_size} bytes, header says "
                             f"{n} sequences / {d} documents = {idx_nbytes(n, d)} bytes")
        self.dtype = DTYPE_CODES[code]
        bin_size = os.path.getsize(bin_path)
        if bin_size != num_tokens * self.dtype.itemsize:
            raise ValueError(f"{bin_path} is truncated or corrupt: {bin_size} bytes, index says "
                             f"{num_tokens} tokens of {self.dtype.name}")
        # Plain ndarray views of the maps (slicing an np.memmap subclass costs ~5 µs of Python per call), which hold
        # no file descriptor (``map_file``): hundreds of shards per process.
        idx = map_file(idx_path)
        off = HEADER_BYTES
        self.offsets = idx[off:off + 8 * n].view("<i8")
        off += 8 * n
        self.doc_idx = idx[off:off + 8 * (d + 1)].view("<i8")
        off += 8 * (d + 1)
        self.sizes = idx[off:off + 4 * n].view("<i4")
        self.num_tokens = int(num_tokens)
        if check:
            self._check(idx_path)
        self._bin = map_file(bin_path).view(self.dtype) if num_tokens else np.zeros(0, self.dtype)

    def _check(self, idx_path: str, chunk: int = 1 << 20) -> None:
        """Structural invariants (O(N), in chunks: bounded temporary memory): contiguous offsets, monotone
        document bounds."""
        n = len(self.sizes)
        if n == 0 and self.num_tokens != 0:
            raise ValueError(f"{idx_path} is corrupt: no sequences but {self.num_tokens} tokens")
        if n and (self.offsets[0] != 0 or int(self.offsets[-1]) + int(self.sizes[-1]) != self.num_tokens):
            raise ValueError(f"{idx_path} is corrupt: sizes/offsets do not tile the .bin file")
        for a in range(0, n, chunk):
            b = min(n, a + chunk + 1)  # one overlapping entry links consecutive chunks
            sizes, offsets = self.sizes[a:b], self.offsets[a:b]
            if sizes.min() < 0 or not np.array_equal(offsets[1:], offsets[:-1] + sizes[:-1]):
                raise ValueError(f"{idx_path} is corrupt: sizes/offsets do not tile the .bin file")
        di = self.doc_idx
        if di[0] != 0 or di[-1] != n:
            raise ValueError(f"{idx_path} is corrupt: document boundaries are not increasing from 0 to {n}")
        for a in range(0, len(di) - 1, chunk):
            if np.any(np.diff(di[a:a + chunk + 1]) <= 0):
                raise ValueError(f"{idx_path} is corrupt: document boundaries are not increasing from 0 to {n}")

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def num_documents(self) -> int:
        return len(self.doc_idx) - 1

    def __getitem__(self, i: int) -> np.ndarray:
        n = len(self.sizes)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sequence index {i} out of range for {n} sequences in {self.prefix}")
        start = int(self.offsets[i])
        return self._bin[start:start + int(self.sizes[i])]

    def __getstate__(self) -> dict:
        return {"prefix": self.prefix}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["prefix"])


_SLICE = 1 << 18
"""Sentences per slice when a builder writes its index."""


class IndexedDatasetBuilder:
    """Streams sequences into ``<prefix>.bin``; ``finalize`` publishes .bin then .idx atomically."""

    def __init__(self, prefix: str, vocab_size: int) -> None:
        self.prefix = str(prefix)
        self.vocab_size = int(vocab_size)
        self.dtype = best_dtype(vocab_size)
        self._bin_tmp = self.prefix + ".bin.tmp"
        self._bin = open(self._bin_tmp, "wb")
        self._bin_hash = hashlib.sha256()
        self._sizes = array("i")
        self._doc_idx = array("q", [0])
        self.num_tokens = 0
        self._finalized = False

    def add_item(self, ids) -> None:
        """Append one sequence (any int sequence / array with ids < vocab_size)."""
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise ValueError(f"add_item expects a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.size and (arr.min() < 0 or arr.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size}) in sequence {len(self._sizes)}")
        data = arr.astype(self.dtype, copy=False).tobytes()
        self._bin.write(data)
        self._bin_hash.update(data)
        self._sizes.append(arr.size)
        self.num_tokens += int(arr.size)

    def add_items(self, flat_ids: np.ndarray, sizes: np.ndarray) -> None:
        """Append many sequences given as one flat id array and their lengths (fast path)."""
        flat = np.asarray(flat_ids)
        sizes = np.asarray(sizes, dtype=np.int64)
        if int(sizes.sum()) != flat.size:
            raise ValueError(f"sizes sum to {int(sizes.sum())} but {flat.size} ids were given")
        if flat.size and (flat.min() < 0 or flat.max() >= self.vocab_size):
            raise ValueError(f"token id out of range [0, {self.vocab_size})")
        data = flat.astype(self.dtype, copy=False).tobytes()
        self._bin.write(data)
        self._bin_hash.update(data)
        self._sizes.frombytes(sizes.astype(np.int32).tobytes())  # array('i') is int32 on every platform we run
        self.num_tokens += int(flat.size)

    def add_documents(self, flat_ids: np.ndarray, sizes: np.ndarray, doc_sentences: np.ndarray) -> None:
        """Append whole documents at once: ``doc_sentences[d]`` sequences each (0: none, skipped), their lengths
        ``sizes`` and ids ``flat_ids`` end to end; the same files as ``add_items`` + ``end_document`` per document,
        in one write (the preprocessing's main process writes every worker's output: one call a chunk, not one
        a document). The current document, if any sequences were added to it, is closed first."""
        counts = np.asarray(doc_sentences, dtype=np.int64)
        if counts.size and counts.min() < 0:
            raise ValueError("doc_sentences must be >= 0")
        if int(counts.sum()) != len(sizes):
            raise ValueError(f"doc_sentences sum to {int(counts.sum())} but {len(sizes)} sizes were given")
        self.end_document()
        base = len(self._sizes)
        self.add_items(flat_ids, sizes)
        ends = base + np.cumsum(counts[counts > 0])
        self._doc_idx.frombytes(ends.astype(np.int64).tobytes())  # array('q') is int64

    def end_document(self) -> None:
        """Close the current document; a document with no sequences is ignored."""
        if len(self._sizes) > self._doc_idx[-1]:
            self._doc_idx.append(len(self._sizes))

    @property
    def num_sequences(self) -> int:
        return len(self._sizes)

    def finalize(self) -> dict:
        """Write the index and publish both files; returns counts, byte sizes, sha256 and sampled sha256
        (``SAMPLING``) of each file: the shard's manifest entry but its name."""
        if self._finalized:
            raise RuntimeError("IndexedDatasetBuilder.finalize called twice")
        self.end_document()
        self._finalized = True
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        sizes = np.frombuffer(self._sizes, dtype=np.int32) if len(self._sizes) else np.zeros(0, np.int32)
        doc_idx = np.frombuffer(self._doc_idx, dtype=np.int64)
        header = _HEADER.pack(MAGIC, VERSION, _CODE_OF[self.dtype], len(sizes), len(doc_idx) - 1, self.num_tokens)
        idx_tmp = self.prefix + ".idx.tmp"
        idx_hash, idx_bytes = hashlib.sha256(), 0
        with open(idx_tmp, "wb") as f:
            # Written and hashed slice by slice: the finalize peak stays a few MB over the shard's sizes,
            # however many sentences the shard holds.
            def put(data: bytes) -> None:
                nonlocal idx_bytes
                f.write(data)
                idx_hash.update(data)
                idx_bytes += len(data)

            put(header)
            start = 0
            for a in range(0, len(sizes), _SLICE):
                part = sizes[a:a + _SLICE].astype("<i8")
                offsets = np.cumsum(part) - part + start  # exclusive prefix sums, continued across slices
                start += int(part.sum())
                put(offsets.tobytes())
            for a in range(0, len(doc_idx), _SLICE):
                put(doc_idx[a:a + _SLICE].astype("<i8").tobytes())
            for a in range(0, len(sizes), _SLICE):
                put(sizes[a:a + _SLICE].astype("<i4").tobytes())
            f.flush()
            os.fsync(f.fileno())
        os.replace(self._bin_tmp, self.prefix + ".bin")
        os.replace(idx_tmp, self.prefix + ".idx")
        # The sampled digests read back a few blocks of the files just written (from the page cache).
        return {"num_sequences": len(sizes), "num_documents": len(doc_idx) - 1, "num_tokens": self.num_tokens,
                "dtype": self.dtype.name, "bin_bytes": self.num_tokens * self.dtype.itemsize,
                "idx_bytes": idx_bytes, "bin_sha256": self._bin_hash.hexdigest(),
                "idx_sha256": idx_hash.hexdigest(), "bin_sampled_sha256": sampled_sha256(self.prefix + ".bin"),
                "idx_sampled_sha256": sampled_sha256(self.prefix + ".idx")}

    def abort(self) -> None:
        """Drop the partial shard (temporary files only; nothing was published)."""
        if not self._finalized:
            self._finalized = True
            self._bin.close()
            for p in (self._bin_tmp, self.prefix + ".idx.tmp"):
                if os.path.exists(p):
                    os.unlink(p)
