"""Training samples: an MLM sequence plus two CLEAR views of the same text, and source blending.

Shape legend: T = MLM sequence length (<= max_len), Ta/Tb = view lengths (<= view_max_len),
N = samples, D = documents.

A sample is a run of contiguous sentences of one document whose tokens fit in
``max_len - 2`` (a single longer sentence is truncated); with ``data.packing=full`` the run goes on across
documents, a [SEP] before each document that starts inside it (separators count in the budget). Its noise comes from counter-based draws keyed
by ``(seed, epoch, index)`` (``counter_rng``), in separate streams for the masking and each view, so a sample
depends only on its key, never on the batch it is built in or the worker that builds it. Which sentences make
each sample: ``sample_index.py`` (packing and the cached, memory-mapped index).
"""

from __future__ import annotations

import numpy as np
import torch

from pretrain.config.data import DataConfig
from pretrain.data.augment import build_augmenter
from pretrain.data.counter_rng import derive, sample_keys
from pretrain.data.masking import mask_batch, special_table
from pretrain.data.ragged import Ragged, insert_before
from pretrain.data.sample_index import load_or_build_sample_index, separators
from pretrain.data.shards import ShardedDataset


def parse_key(key) -> tuple[int, int]:
    """(epoch, index) from a key tuple, or (0, index) from a bare int."""
    if isinstance(key, (tuple, list)):
        epoch, index = key
        return int(epoch), int(index)
    return 0, int(key)


VIEW_A, VIEW_B = 1, 2
"""``counter_rng.derive`` tags of the two views' keys (the masking draws from the sample's own key)."""
SAMPLE_STREAM = "counter-v3"
"""Names the rule mapping (seed, epoch, index) to a sample's noise; checkpoints record it, and a run is not
resumed into another one (v1: numpy Generator per sample; v2: counter_rng draws, batched; v3: the views keep
[CLS]/[SEP]/[PAD]/[MASK] inside the text in place and a deletion leaves a text at least one word)."""
STREAM_FIXES = {"counter-v2": "its views differ from this version's only where they were wrong: a one-word text's "
                              "deletion views left without a word, and [SEP]s inside data.packing=full text deleted "
                              "or moved"}
"""Older streams a checkpoint may be resumed from into ``SAMPLE_STREAM`` (with a warning), and how they differ: every
sample they draw alike is bitwise the same, so a resume continues the run exactly but for those samples' views."""


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
        self.word_start_V = tokenizer.word_start_mask() if cfg.masking.scheme != "token" else None
        """bool [V] for whole-word and span masking."""
        self.cls_id, self.sep_id, self.mask_id = tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id
        self.augmenter = build_augmenter(cfg.augment, tokenizer) if with_views else None
        self.index = load_or_build_sample_index(source, cfg.max_len - 2, cfg.packing)

    def __len__(self) -> int:
        return len(self.index)

    @property
    def data_identity(self) -> str | None:
        """What this training set is, for a resume to compare (``data_identity``): its dataset's manifest and its
        number of samples; None for a source without a manifest."""
        digest = getattr(self.source, "manifest_digest", None)
        return None if digest is None else f"shards {digest}, {len(self)} samples"

    def text(self, index: int) -> np.ndarray:
        """Token ids (no specials) of sample ``index``, at most max_len - 2 of them, sentence by sentence (a
        source without ``token_batch``)."""
        first, end = self.index.range(index)
        return np.concatenate([np.asarray(self.source[i]) for i in range(first, end)])[:self.cfg.max_len - 2]

    def texts(self, index_B: np.ndarray) -> Ragged:
        """``text`` of many samples, gathered at once from a ShardedDataset (one sample at a time otherwise); with
        packing "full", a [SEP] before each document that starts inside a sample."""
        budget = self.cfg.max_len - 2
        if not hasattr(self.source, "token_batch"):
            text = Ragged.from_rows([self.text(i) for i in index_B.tolist()])
        else:
            text = Ragged(*self.source.token_batch(*self.index.ranges(index_B), budget))
        if self.cfg.packing != "full":
            return text
        rows_K, pos_K = separators(self.source, *self.index.ranges(index_B))
        keep = pos_K < text.len[rows_K]
        return insert_before(text, rows_K[keep], pos_K[keep], self.sep_id).truncate(budget)

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
                                         allowed_A=self.allowed_A, mask_id=self.mask_id,
                                         word_start_V=self.word_start_V)
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

    @property
    def data_identity(self) -> str | None:
        """Every source's identity with its weight (``data_identity``); None when one has none."""
        parts = [getattr(d, "data_identity", None) for d in self.datasets]
        if any(p is None for p in parts):
            return None
        return "blend of " + "; ".join(f"{p} x{w:g}" for p, w in zip(parts, self.weights))

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
    datasets = [PretrainDataset(ShardedDataset(s.path, tokenizer_sha256=sha, cache_dir=cfg.index_cache_dir), tokenizer,
                                cfg, seed=seed)
                for s in sources]
    if len(datasets) == 1:
        return datasets[0]
    return BlendedDataset(datasets, [s.weight for s in sources], seed=seed)


def data_identity(dataset) -> str | None:
    """A short digest of what a training set is (its datasets' manifests, their weights, its number of samples; a
    text file's bytes), recorded in every checkpoint: a resume on another training set at the same path would go
    on at the checkpoint's sample position in another order without a word. None where it cannot be told."""
    import hashlib

    described = getattr(dataset, "data_identity", None)
    return None if described is None else hashlib.sha256(described.encode()).hexdigest()[:20]
