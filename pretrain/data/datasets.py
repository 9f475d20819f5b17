"""Training samples: an MLM sequence plus two CLEAR views of the same text, and source blending.

Shape legend: T = MLM sequence length (<= max_len), Ta/Tb = view lengths (<= view_max_len),
N = samples, D = documents.

A sample is a run of contiguous sentences of one document whose tokens fit in
``max_len - 2`` (a single longer sentence is truncated). Its noise comes from
``np.random.default_rng([seed, epoch, index])``, split into independent streams for
the masking and each view, so a sample depends only on its key, never on workers.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
import torch

from pretrain.config.data import DataConfig
from pretrain.data.augment import build_augmenter
from pretrain.data.masking import mask_tokens, with_cls_sep
from pretrain.data.shards import ShardedDataset


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
    sizes = np.asarray(sizes)
    if sizes.dtype not in (np.int32, np.int64):
        sizes = sizes.astype(np.int64)
    first, end = _index.pack(np.ascontiguousarray(sizes), np.ascontiguousarray(doc_idx, dtype=np.int64), int(budget))
    return np.frombuffer(first, dtype=np.int64), np.frombuffer(end, dtype=np.int64)


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
INDEX_CACHE_DIR = "index-cache"


def index_cache_path(source, budget: int) -> Path | None:
    """<dataset>/index-cache/samples-<manifest sha256>-b<budget>-<rule>.npy for a ShardedDataset; None otherwise.

    The key names exactly what the index depends on: the dataset (its manifest, which checksums every
    shard), the token budget (max_len - 2) and the packing rule; a cache of anything else is another file."""
    directory = getattr(source, "directory", None)
    manifest = Path(directory) / "manifest.json" if directory else None
    if manifest is None or not manifest.is_file():
        return None
    digest = hashlib.sha256(manifest.read_bytes()).hexdigest()[:20]
    return Path(directory) / INDEX_CACHE_DIR / f"samples-{digest}-b{budget}-{INDEX_RULE}.npy"


def _open_cached_index(path: Path, num_sentences: int) -> tuple[np.ndarray, np.ndarray] | None:
    """The cached (first_N, end_N), memory-mapped; None when absent or damaged (a damaged one is never used)."""
    try:
        arr = np.load(path, mmap_mode="r", allow_pickle=False)
    except FileNotFoundError:
        return None
    except (ValueError, OSError) as e:  # truncated or not an .npy: rebuild
        print(f"[data] sample index cache {path} is damaged ({e}); rebuilding it", flush=True)
        return None
    ok = arr.ndim == 2 and arr.shape[0] == 2 and arr.dtype == np.int64
    if ok and arr.shape[1]:  # cheap structural checks on the ends (a full scan would cost seconds at 1e9)
        ok = 0 <= int(arr[0, 0]) < int(arr[1, 0]) and 0 < int(arr[1, -1]) <= num_sentences
    if not ok:
        print(f"[data] sample index cache {path} does not fit its dataset; rebuilding it", flush=True)
        return None
    return arr[0], arr[1]


def load_or_build_sample_index(source, budget: int) -> tuple[np.ndarray, np.ndarray, Path | None]:
    """(first_N, end_N, cache path or None): memory-mapped from the dataset's index cache, or built (and
    cached, atomically: a file appears complete under its name or not at all; concurrent builders write
    identical bytes and the last rename wins). A read-only dataset directory is built in memory."""
    path = index_cache_path(source, budget)
    if path is not None:
        cached = _open_cached_index(path, len(source))
        if cached is not None:
            return cached[0], cached[1], path
    first_N, end_N = _build_index_of(source, budget)
    if path is None:
        return first_N, end_N, None
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        path.parent.mkdir(exist_ok=True)
        with open(tmp, "wb") as f:
            np.save(f, np.stack([first_N, end_N]), allow_pickle=False)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:  # read-only or full: train from the in-memory index
        print(f"[data] could not cache the sample index in {path.parent} ({e}); using it from memory", flush=True)
        tmp.unlink(missing_ok=True)
        return first_N, end_N, None
    cached = _open_cached_index(path, len(source))
    return (cached[0], cached[1], path) if cached is not None else (first_N, end_N, None)


def _build_index_of(source, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """The sample index of a source; shard by shard for a ShardedDataset (documents never cross shards), so
    that only the shards' memory-mapped sizes are read and no corpus-sized copy is made."""
    shards = getattr(source, "shards", None)
    if shards is None:
        return build_sample_index(source.sizes, source.doc_idx, budget)
    firsts, ends = [], []
    for shard, start in zip(shards, source.starts.tolist()):
        f, e = build_sample_index(shard.sizes, shard.doc_idx, budget)
        firsts.append(f + start)
        ends.append(e + start)
    if not firsts:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(firsts), np.concatenate(ends)


def parse_key(key) -> tuple[int, int]:
    """(epoch, index) from a key tuple, or (0, index) from a bare int."""
    if isinstance(key, (tuple, list)):
        epoch, index = key
        return int(epoch), int(index)
    return 0, int(key)


class PretrainDataset(torch.utils.data.Dataset):
    """Samples of one source (a ShardedDataset-like object: sizes, doc_idx, __getitem__)."""

    def __init__(self, source, tokenizer, cfg: DataConfig, *, seed: int, with_views: bool = True):
        self.source = source
        self.cfg = cfg
        self.seed = int(seed)
        self.with_views = with_views
        self.vocab_size = tokenizer.vocab_size
        self.special_ids = tuple(sorted(tokenizer.special_ids))
        self.cls_id, self.sep_id, self.mask_id = tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id
        self.augmenter = build_augmenter(cfg.augment, tokenizer) if with_views else None
        self.first_N, self.end_N, self.index_path = load_or_build_sample_index(source, cfg.max_len - 2)

    def __getstate__(self) -> dict:
        # DataLoader workers re-map the cached index instead of receiving a pickled copy of it.
        state = dict(self.__dict__)
        if self.index_path is not None:
            state["first_N"] = state["end_N"] = None
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        if self.first_N is None:
            arr = np.load(self.index_path, mmap_mode="r", allow_pickle=False)
            self.first_N, self.end_N = arr[0], arr[1]

    def __len__(self) -> int:
        return len(self.first_N)

    def text(self, index: int) -> np.ndarray:
        """Token ids (int64, no specials) of sample ``index``, at most max_len - 2 of them."""
        budget = self.cfg.max_len - 2
        parts = [np.asarray(self.source[i]) for i in range(self.first_N[index], self.end_N[index])]
        return np.concatenate(parts).astype(np.int64)[:budget]

    def __getitem__(self, key) -> dict:
        """key = (epoch, index); index >= len reuses the text of index % len with fresh noise."""
        epoch, index = parse_key(key)
        n = len(self)
        if index < 0 or n == 0:
            raise IndexError(f"sample index {index} out of range for a dataset of {n} samples")
        tokens_T = self.text(index % n)
        rng_mask, rng_a, rng_b = np.random.default_rng([self.seed, epoch, index]).spawn(3)
        seq_T = self.wrap(tokens_T)
        input_T, labels_T = mask_tokens(
            seq_T,
            rng_mask,
            self.cfg.masking,
            vocab_size=self.vocab_size,
            special_ids=self.special_ids,
            mask_id=self.mask_id,
        )
        sample = {"input_ids": input_T, "mlm_labels": labels_T}
        if self.augmenter is not None:
            budget = self.cfg.view_max_len - 2
            sample["view_a"] = self.wrap(self.augmenter(tokens_T, rng_a)[:budget])
            sample["view_b"] = self.wrap(self.augmenter(tokens_T, rng_b)[:budget])
        return sample

    def wrap(self, tokens_T: np.ndarray) -> np.ndarray:
        return with_cls_sep(tokens_T, self.cls_id, self.sep_id)


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
    source s sits at time (c + 0.5) / count_s; a stable sort merges them). Within a source the
    window of samples rotates by one epoch's count each epoch, from a seed-chosen offset, so a
    down-weighted source still cycles through all its samples over epochs.
    """

    def __init__(self, datasets: list, weights: list[float], *, seed: int):
        if not datasets or len(datasets) != len(weights):
            raise ValueError(f"BlendedDataset needs one weight per dataset, got {len(datasets)} and {len(weights)}")
        if any(w <= 0 for w in weights):
            raise ValueError(f"data.sources weights must be > 0, got {weights}")
        sizes = [len(d) for d in datasets]
        if any(n == 0 for n in sizes):
            raise ValueError(f"a blended source has no samples (sizes {sizes}); check the dataset directories")
        self.datasets = datasets
        self.weights = [float(w) for w in weights]
        self.counts_S = apportion(sum(sizes), weights)
        times = [(np.arange(c) + 0.5) / c for c in self.counts_S.tolist()]
        sources = [np.full(c, s, dtype=np.int16) for s, c in enumerate(self.counts_S.tolist())]
        order_N = np.argsort(np.concatenate(times), kind="stable")
        self.source_N = np.concatenate(sources)[order_N]
        draws = np.concatenate([np.arange(c, dtype=np.int64) for c in self.counts_S.tolist()])
        self.draw_N = draws[order_N]
        self.offset_S = np.array(
            [np.random.default_rng([seed, s]).integers(n) for s, n in enumerate(sizes)], dtype=np.int64
        )

    def __len__(self) -> int:
        return len(self.source_N)

    def locate(self, epoch: int, index: int) -> tuple[int, int]:
        """(source, position in that source) of blended sample ``index`` in ``epoch``."""
        s = int(self.source_N[index])
        return s, int(self.offset_S[s] + epoch * self.counts_S[s] + self.draw_N[index])

    def __getitem__(self, key) -> dict:
        epoch, index = parse_key(key)
        s, position = self.locate(epoch, index)
        sample = self.datasets[s][(epoch, position)]
        sample["source"] = s
        return sample


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
