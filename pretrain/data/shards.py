"""A preprocessed dataset directory: ``manifest.json`` + ``shard-NNNNN.{bin,idx}`` (+ ``token_freq.npy``).

``ShardedDataset`` gives one global sentence index over all shards; ``verify_dataset`` re-checks checksums
and structure. A directory without ``manifest.json`` is an incomplete (or failed) preprocessing run.
Opening checks each new or changed shard's structure and sampled sha256; only ``verify_dataset`` reads every byte.
Legend: N = total sequences (sentences), D = total documents, V = vocabulary size.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from pathlib import Path

import numpy as np

from pretrain.data.indexed import IndexedDataset, file_sha256, sampled_sha256
from pretrain.distributed.env import unique_suffix
from pretrain.fsutil import fsync_dir, inside

MANIFEST = "manifest.json"
FORMAT_NAME = "pretrain-sharded-dataset"
FORMAT_VERSION = 1
TOKEN_FREQ = "token_freq.npy"
INDEX_CACHE_DIR = "index-cache"
"""Derived files of a dataset (sample index caches, checked stamps), keyed by ``ShardedDataset.manifest_digest``."""


class CorruptShardError(ValueError):
    """A shard holds a token id outside the dataset's vocabulary. Raised where ids are read, before any device
    sees them. Re-raised from a DataLoader worker, it keeps only its own message (torch builds the re-raised
    exception from the worker's whole traceback text)."""

    def __init__(self, message: str) -> None:
        marker = f"{type(self).__name__}: "
        if "Original Traceback" in message and marker in message:
            message = message.rsplit(marker, 1)[1].strip()
        super().__init__(message)


def write_manifest(directory: str | os.PathLike, manifest: dict) -> None:
    """Write ``manifest.json`` durably and atomically (fsync, then rename): the dataset's completion mark."""
    manifest = dict(manifest, format=FORMAT_NAME, format_version=FORMAT_VERSION)
    path = Path(directory) / MANIFEST
    tmp = path.with_name(MANIFEST + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(directory: str) -> dict:
    """Parsed manifest.json, or FileNotFoundError/ValueError saying the dataset is incomplete/unusable."""
    path = Path(directory) / MANIFEST
    if not Path(directory).is_dir():
        raise FileNotFoundError(f"dataset directory {directory} does not exist; run pretrain-preprocess first")
    if not path.is_file():
        raw = _raw_inputs(Path(directory))
        if raw:
            out = str(directory).rstrip("/") + "-data"
            raise FileNotFoundError(
                f"{directory} holds raw input files ({', '.join(raw)}), not a preprocessed dataset (it has no "
                f"{MANIFEST} and no shards); preprocess it first:\n  pretrain-preprocess {directory} --tokenizer "
                f"<the data.tokenizer of this run> --out {out}\nthen give {out} as the data source")
        raise FileNotFoundError(f"{directory} has no {MANIFEST}: the dataset is incomplete (preprocessing did not "
                                f"finish); re-run pretrain-preprocess")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{path} is not valid JSON ({e}); re-run pretrain-preprocess") from None
    if manifest.get("format") != FORMAT_NAME or manifest.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path}: unsupported format {manifest.get('format')!r} version "
                         f"{manifest.get('format_version')!r}; expected {FORMAT_NAME} v{FORMAT_VERSION}")
    return manifest


def _raw_inputs(directory: Path, limit: int = 3) -> list[str]:
    """Up to ``limit`` names of the files below ``directory`` when it holds no shard (a corpus given where a
    dataset belongs); [] when it has shards (an interrupted run) or no files."""
    if any(p.name.startswith("shard-") for p in directory.glob("shard-*")):
        return []
    names: list[str] = []
    for root, dirs, files in os.walk(directory):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d != INDEX_CACHE_DIR)
        names += [os.path.relpath(os.path.join(root, f), directory) for f in sorted(files) if not f.startswith(".")]
        if len(names) >= limit:
            break
    return names[:limit]


class ShardedDataset:
    """All shards of one dataset behind one global sentence index; pickles by directory."""

    def __init__(self, directory: str, *, tokenizer_sha256: str | None = None, cache_dir: str = "") -> None:
        self.directory = str(directory)
        self._tokenizer_sha256, self._cache_dir = tokenizer_sha256, str(cache_dir or "")
        self.cache_dir = Path(cache_dir) if cache_dir else Path(self.directory) / INDEX_CACHE_DIR
        """Where this dataset's index caches live (``data.index_cache_dir``, else ``<directory>/index-cache``)."""
        self.manifest = read_manifest(self.directory)
        self.manifest_digest = hashlib.sha256((Path(self.directory) / MANIFEST).read_bytes()).hexdigest()[:20]
        """Names this exact dataset (the manifest checksums every shard): the key of its index-cache files."""
        have = self.manifest["tokenizer"]["sha256"]
        if tokenizer_sha256 is not None and have != tokenizer_sha256:
            raise ValueError(
                f"dataset {directory} was tokenized with tokenizer sha256 {have[:16]}… "
                f"({self.manifest['tokenizer'].get('path')}), but the configured tokenizer has sha256 "
                f"{tokenizer_sha256[:16]}…; re-run pretrain-preprocess with that tokenizer")
        for s in self.manifest["shards"]:  # the dataset's own files (paths read from the manifest)
            _own_files(self.directory, f"{s['name']}.bin", f"{s['name']}.idx")
        stamp_path, stamp = self._checked_stamp()
        known = _read_json(stamp_path) if stamp_path is not None else None
        checked = {s["name"] for s in self.manifest["shards"]
                   if known is None or known.get(s["name"]) != stamp.get(s["name"])}
        self.shards = [IndexedDataset(os.path.join(self.directory, s["name"]), check=s["name"] in checked)
                       for s in self.manifest["shards"]]
        # Structure intact, content changed since preprocessing (a copy cut by a crash, zero-filled at full size):
        # the sampled sha256 reads a few blocks, the file's end among them.
        changed = _changed_files(self.directory, self.manifest, checked)
        if changed:
            more = f" (and {len(changed) - 1} other shard files)" if len(changed) > 1 else ""
            raise ValueError(
                f"{changed[0]}{more} differs from when it was preprocessed (its sampled sha256 does not match "
                f"{MANIFEST}: e.g. a zero-filled or cut end left by an interrupted copy); copy it again from the "
                f"source or re-run pretrain-preprocess (pretrain-preprocess --verify {directory} checks every file "
                f"whole)")
        if stamp_path is not None and known != stamp:
            # What was checked may still be only in the page cache (a copy just made): on the disk first, so that a
            # crash cannot leave a stamp vouching for files whose ends read back as zeros at the same size and mtime.
            for path in (os.path.join(self.directory, name + ext) for name in checked for ext in (".idx", ".bin")):
                fsync_dir(path)  # a file's dirty pages too (opened read-only, as Linux allows)
            _write_json_quietly(stamp_path, stamp)
        for shard, entry in zip(self.shards, self.manifest["shards"]):
            if len(shard) != entry["num_sequences"] or shard.num_tokens != entry["num_tokens"]:
                raise ValueError(f"{shard.prefix} does not match {MANIFEST} (sequence/token counts differ); "
                                 f"run pretrain-preprocess --verify {directory}")
        counts = np.array([len(s) for s in self.shards], dtype=np.int64)
        self.starts = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        """Global index of each shard's first sentence (+ the total), int64 [S + 1]."""
        self.num_documents = int(sum(len(s.doc_idx) - 1 for s in self.shards))
        self.num_tokens = int(sum(s.num_tokens for s in self.shards))
        self.vocab_size = int(self.manifest["tokenizer"]["vocab_size"])
        self.tokenizer_sha256 = have

    def __len__(self) -> int:
        return int(self.starts[-1])

    def _checked_stamp(self) -> tuple[Path | None, dict]:
        """(``index-cache/checked-<manifest sha>.json``, {shard: [size, mtime_ns, inode, ctime_ns] of its .idx and
        .bin}): a copy keeps neither inode nor ctime, so a stamp copied along (``cp -p``, ``rsync -a``, which keep
        the mtime) does not vouch for the copies, which a cut copy's zero-filled end would otherwise pass.

        The shards' O(N) structural check (4 s at 1e9 sentences) and sampled sha256 run once per set of files: the
        stamp records the files that passed, and a shard whose files still have that size and mtime opens without
        them (the sha256 of every file is ``pretrain-preprocess --verify``'s job)."""
        stamp = {}
        for s in self.manifest["shards"]:
            prefix = os.path.join(self.directory, s["name"])
            try:
                stat = [os.stat(prefix + ext) for ext in (".idx", ".bin")]
            except OSError:
                return None, {}  # a missing file: IndexedDataset says which
            stamp[s["name"]] = [[st.st_size, st.st_mtime_ns, st.st_ino, st.st_ctime_ns] for st in stat]
        return self.cache_dir / f"checked-{self.manifest_digest}.json", stamp

    @functools.cached_property
    def sizes(self) -> np.ndarray:
        """Tokens per sentence over all shards, int32 [N]: a copy in RAM (4 bytes a sentence), made on first use.
        The sample index reads the shards' memory-mapped sizes instead (``load_or_build_sample_index``)."""
        return (np.concatenate([np.asarray(s.sizes) for s in self.shards]).astype(np.int32)
                if self.shards else np.zeros(0, np.int32))

    @functools.cached_property
    def doc_idx(self) -> np.ndarray:
        """Global document boundaries, int64 [D + 1]: a copy in RAM, made on first use."""
        bounds = [np.asarray(s.doc_idx[:-1]) + start for s, start in zip(self.shards, self.starts)]
        return np.concatenate(bounds + [np.array([self.starts[-1]])]).astype(np.int64)

    def __getitem__(self, i: int) -> np.ndarray:
        """Token ids of global sentence ``i`` (memmap view; copy before modifying)."""
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"sentence index {i} out of range for {n} sentences in {self.directory}")
        k = int(np.searchsorted(self.starts, i, side="right")) - 1
        ids = self.shards[k][i - int(self.starts[k])]
        if len(ids) and (ids.max() >= self.vocab_size or (ids.dtype.kind == "i" and ids.min() < 0)):
            self._corrupt(k, int(self.shards[k].offsets[i - int(self.starts[k])]), ids)
        return ids

    def token_batch(self, first_B: np.ndarray, end_B: np.ndarray, limit: int) -> tuple[np.ndarray, np.ndarray]:
        """The first ``limit`` tokens of global sentences ``first .. end - 1`` for each of B ranges, which must each
        lie in one shard (a sample never crosses a document, nor a document a shard): (ids int64 [B, T]
        zero-padded, len int64 [B]), one gather per shard."""
        first_B, end_B = np.asarray(first_B, dtype=np.int64), np.asarray(end_B, dtype=np.int64)
        k_B = np.searchsorted(self.starts, first_B, side="right") - 1
        if len(first_B) and ((first_B < 0).any() or (k_B >= len(self.shards)).any()
                             or (end_B <= first_B).any() or (end_B > self.starts[np.minimum(k_B + 1, len(self.shards))]).any()):
            raise IndexError(f"a sentence range of {list(zip(first_B.tolist(), end_B.tolist()))} is not inside one "
                             f"shard of {self.directory}")
        begin_B = np.zeros(len(first_B), dtype=np.int64)
        len_B = np.zeros(len(first_B), dtype=np.int64)
        for k in np.unique(k_B).tolist():
            rows = np.flatnonzero(k_B == k)
            shard, base = self.shards[k], int(self.starts[k])
            first, last = first_B[rows] - base, end_B[rows] - 1 - base
            begin_B[rows] = shard.offsets[first]
            len_B[rows] = np.minimum(shard.offsets[last] + shard.sizes[last] - begin_B[rows], limit)
        T = int(len_B.max(initial=0))
        valid_BT = np.arange(T) < len_B[:, None]
        ids_BT = np.zeros((len(first_B), T), dtype=np.int64)
        for k in np.unique(k_B).tolist():
            rows = np.flatnonzero(k_B == k)
            pos = np.where(valid_BT[rows], begin_B[rows, None] + np.arange(T), 0)
            ids_BT[rows] = np.where(valid_BT[rows], self.shards[k]._bin[pos], 0)
        # One vectorised pass (a negative id is huge as uint64): bad bytes stop here, named, not on the device.
        if ids_BT.size and ids_BT.view(np.uint64).max() >= self.vocab_size:
            row = int(np.flatnonzero((ids_BT.view(np.uint64) >= self.vocab_size).any(axis=1))[0])
            self._corrupt(int(k_B[row]), int(begin_B[row]), ids_BT[row, :len_B[row]])
        return ids_BT, len_B

    def _corrupt(self, k: int, offset: int, ids: np.ndarray) -> None:
        """CorruptShardError naming shard ``k``'s .bin, the token offset and byte offset of the first bad id in
        ``ids`` (which start at token ``offset`` of that shard)."""
        ids = np.asarray(ids, dtype=np.int64)
        j = int(np.flatnonzero((ids < 0) | (ids >= self.vocab_size))[0])
        shard = self.shards[k]
        raise CorruptShardError(
            f"{shard.prefix}.bin holds token id {int(ids[j])} at token offset {offset + j} (byte "
            f"{(offset + j) * shard.dtype.itemsize}), outside the dataset's vocabulary of {self.vocab_size} ids: the "
            f"file is corrupt (a flipped bit, a bad copy). Run pretrain-preprocess --verify {self.directory} to check "
            f"every shard against its checksum, then copy the shard again or re-run pretrain-preprocess.")

    def token_frequencies(self) -> np.ndarray | None:
        """float64 [V] unigram frequencies over the dataset (sums to 1), or None when not stored."""
        path = os.path.join(self.directory, TOKEN_FREQ)
        if not os.path.isfile(path):
            return None
        return np.load(path, allow_pickle=False)

    def __getstate__(self) -> dict:
        return {"directory": self.directory, "tokenizer_sha256": self._tokenizer_sha256, "cache_dir": self._cache_dir}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["directory"], tokenizer_sha256=state["tokenizer_sha256"], cache_dir=state["cache_dir"])


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _write_json_quietly(path: Path, data: dict) -> None:
    """Atomic write; a read-only or full dataset directory just goes without (the check runs again next time)."""
    tmp = path.with_name(f".{path.name}.tmp-{unique_suffix()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        tmp.unlink(missing_ok=True)


def _sampling(manifest: dict, where: str) -> dict | None:
    """The manifest's ``sampled_sha256`` ({"block": bytes, "blocks": count}: how the shards' sampled digests were
    taken), None for a dataset written without them; ValueError naming ``where`` when it is malformed."""
    sampling = manifest.get("sampled_sha256")
    if sampling is None:
        return None
    ok = isinstance(sampling, dict) and all(type(sampling.get(k)) is int for k in ("block", "blocks"))
    if not ok or sampling["block"] < 1 or sampling["blocks"] < 2:
        raise ValueError(f"{where}: sampled_sha256 is {sampling!r}, expected {{'block': bytes >= 1, 'blocks': "
                         f"count >= 2}}; re-run pretrain-preprocess")
    return sampling


def _changed_files(directory: str, manifest: dict, names: set[str]) -> list[str]:
    """The .bin/.idx files of shards ``names`` whose sampled sha256 differs from the manifest's (none checked for a
    manifest, or a shard entry, without sampled digests: a dataset written before they were recorded)."""
    sampling = _sampling(manifest, os.path.join(directory, MANIFEST))
    if sampling is None:
        return []
    changed = []
    for entry in (e for e in manifest["shards"] if e["name"] in names):
        for ext in ("bin", "idx"):
            path, want = os.path.join(directory, f"{entry['name']}.{ext}"), entry.get(f"{ext}_sampled_sha256")
            if want is not None and sampled_sha256(path, sampling) != want:
                changed.append(path)
    return changed


def _own_files(directory: str, *names: str) -> None:
    """ValueError when one of the manifest's ``names`` leads out of the dataset directory ("..", an absolute path).
    A shard file that is a symlink is the user's own arrangement (shards kept on another filesystem) and is read:
    its bytes are checked against the manifest's sizes and hashes as any shard's."""
    for name in names:
        inside(directory, name, listed_in=MANIFEST, links=False)


def verify_dataset(directory: str) -> list[str]:
    """Problems found (empty list = OK): manifest, per-shard files, sizes, sha256, index structure, totals."""
    try:
        manifest = read_manifest(directory)
    except (FileNotFoundError, ValueError) as e:
        return [str(e)]
    problems: list[str] = []
    try:
        sampling = _sampling(manifest, os.path.join(directory, MANIFEST))
    except ValueError as e:
        problems.append(str(e))
        sampling = None
    totals = {"num_sequences": 0, "num_documents": 0, "num_tokens": 0}
    vocab = manifest.get("tokenizer", {}).get("vocab_size", 0)
    for entry in manifest.get("shards", []):
        counts = _shard_problems(directory, entry, vocab, problems, sampling)
        for key, got in (counts or {}).items():
            totals[key] += got
    if not problems:
        for key, got in totals.items():
            if manifest.get(key) != got:
                problems.append(f"manifest total {key} is {manifest.get(key)}, shards sum to {got}")
    if manifest.get("token_freq"):
        problems += _token_freq_problems(directory, manifest["token_freq"], manifest.get("tokenizer", {}))
    return problems


def _shard_problems(directory: str, entry: dict, vocab: int, problems: list[str],
                    sampling: dict | None = None) -> dict | None:
    """One manifest shard entry checked (its files inside the dataset, sizes, sampled sha256 by ``sampling`` then
    sha256, index structure, counts, token ids below ``vocab``), problems appended; its counts, or None when its files
    could not be read."""
    name = entry.get("name", "?")
    try:
        _own_files(directory, f"{name}.bin", f"{name}.idx")
    except ValueError as e:
        problems.append(f"shard {name}: {e}")
        return None
    prefix = os.path.join(directory, name)
    bad = False
    for ext in ("bin", "idx"):
        path, sampled = f"{prefix}.{ext}", entry.get(f"{ext}_sampled_sha256")
        if not os.path.isfile(path):
            problems.append(f"shard {name}: {path} is missing")
            bad = True
        elif os.path.getsize(path) != entry.get(f"{ext}_bytes"):
            problems.append(f"shard {name}: {path} has {os.path.getsize(path)} bytes, manifest says "
                            f"{entry.get(f'{ext}_bytes')}")
            bad = True
        elif sampling and sampled is not None and sampled_sha256(path, sampling) != sampled:  # cheap, first
            problems.append(f"shard {name}: {path} sha256 mismatch (file changed or corrupt: its sampled blocks "
                            f"differ, e.g. a zero-filled or cut end)")
            bad = True
        elif file_sha256(path) != entry.get(f"{ext}_sha256"):
            problems.append(f"shard {name}: {path} sha256 mismatch (file changed or corrupt)")
            bad = True
    if bad:
        return None
    try:
        shard = IndexedDataset(prefix)
    except (FileNotFoundError, ValueError) as e:
        problems.append(f"shard {name}: {e}")
        return None
    counts = {"num_sequences": len(shard), "num_documents": shard.num_documents, "num_tokens": shard.num_tokens}
    for key, got in counts.items():
        if got != entry.get(key):
            problems.append(f"shard {name}: {key} is {got}, manifest says {entry.get(key)}")
    if shard.num_tokens and int(np.max(shard._bin)) >= vocab:
        problems.append(f"shard {name}: token id {int(np.max(shard._bin))} >= vocab_size {vocab}")
    return counts


def _token_freq_problems(directory: str, entry: dict, tokenizer: dict) -> list[str]:
    """The manifest's token_freq.npy: inside the dataset, present, its sha256, float64 [vocab] summing to 1."""
    try:
        _own_files(directory, entry["file"])
    except ValueError as e:
        return [str(e)]
    path = os.path.join(directory, entry["file"])
    if not os.path.isfile(path):
        return [f"{path} is missing"]
    if file_sha256(path) != entry.get("sha256"):
        return [f"{path} sha256 mismatch (file changed or corrupt)"]
    freq = np.load(path, allow_pickle=False)
    vocab = tokenizer.get("vocab_size")
    if freq.dtype != np.float64 or freq.shape != (vocab,) or abs(float(freq.sum()) - 1.0) > 1e-9:
        return [f"{path}: expected float64 [{vocab}] summing to 1, got {freq.dtype} {freq.shape} "
                f"sum {float(freq.sum()):.6f}"]
    return []
