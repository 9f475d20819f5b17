"""The sentence stage: continued training of an encoder on single sentences (SimCSE-style data).

Shape legend: B = sentences in a micro-batch, T = longest sentence (<= data.view_max_len),
Bt = sentences of the batch that carry an ArcCSE triplet, Tt = their longest view
(<= objective.triplet.max_len), V = vocabulary.

Input (``data.sentences``): a text file with one sentence per line (blank lines skipped), or a
``pretrain-preprocess`` directory whose sequences are single sentences; or (``data.pairs``, pretrain/data/pairs.py)
(anchor, positive[, hard negative]) rows, the anchor taking the sentence's place. A sample is keyed by
(epoch, index) like the pretraining samples; its noise (MLM masking, triplet masks) comes from
``np.random.default_rng([seed, epoch, index])``, so it does not depend on workers or resumes.

Batch keys (``collate_sentences``):
  sentence_ids, sentence_mask   [B, T]  the clean sentence, [CLS] ... [SEP]; the dropout views
                                        of SimCSE/ArcCon/RankCSE/SARCSE are two passes of it
  input_ids, attention_mask     [B, T]  = the sentence; with objective.mlm on, a masked copy
  mlm_labels                    [B, T]  only with objective.mlm (-100 where not predicted)
  positive_ids, positive_mask   [B, Tp] only with data.pairs: each anchor's positive; the pair is then
                                        (sentence, positive), not the sentence twice
  negative_ids, negative_mask   [B, Tn] only with data.pairs' third column: each anchor's hard negative
  triplet_index                 [Bt]    rows of the batch that have a triplet (>= min_words words)
  triplet_{anchor,low,high}_ids / _mask  [Bt, Tt]  s, s' (~20% words masked), s'' (~40%, nested)
                                        (only with objective.triplet; Bt may be 0)
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from pretrain.config.data import DataConfig
from pretrain.config.objective import ObjectiveConfig
from pretrain.data.collate import pad_stack
from pretrain.data.containers import STREAM_ERRORS, identify, open_stream, stream_error
from pretrain.data.datasets import parse_key
from pretrain.data.loader import ResumableLoader, build_loader
from pretrain.data.masking import IGNORE_INDEX, mask_tokens, with_cls_sep
from pretrain.data.pairs import read_pairs
from pretrain.data.sample_index import load_or_build_sentence_index
from pretrain.data.shards import ShardedDataset
from pretrain.data.triplet_masks import build_triplet_views

TRIPLET_KEYS = ("triplet_anchor", "triplet_low", "triplet_high")
PAIR_KEYS = ("positive", "negative")
"""data.pairs' samples: the anchor is ``sentence``; these are its positive and hard negative."""


# ----------------------------------------------------------------------------- dataset


class SentenceDataset(torch.utils.data.Dataset):
    """One sample per sentence: the clean sentence, plus MLM / triplet views when those terms are on."""

    def __init__(self, path: str, tokenizer, cfg: DataConfig, objective: ObjectiveConfig, *, seed: int):
        self.path, self.cfg, self.seed = str(path), cfg, int(seed)
        self.mlm = objective.mlm is not None
        self.triplet = objective.triplet
        self.tokenizer = tokenizer
        self.cls_id, self.sep_id, self.mask_id = tokenizer.cls_id, tokenizer.sep_id, tokenizer.mask_id
        self.special_ids = tuple(sorted(tokenizer.special_ids))
        self.vocab_size = tokenizer.vocab_size
        self.lines: list[str] | None = None
        self.source = None
        self._file_digest: str | None = None
        self._open(str(path), tokenizer)
        if len(self.index_N) == 0:
            raise ValueError(f"data.sentences={path} holds no non-empty sentences")
        self._word_start = tokenizer.word_start_mask() if self.triplet is not None else None

    def _open(self, path: str, tokenizer) -> None:
        """Sets ``lines`` (a text file) or ``source`` (a preprocessed directory) and ``index_N``."""
        p = Path(path)
        if p.is_dir():
            self.source = ShardedDataset(str(p), tokenizer_sha256=getattr(tokenizer, "sha256", None),
                                         cache_dir=self.cfg.index_cache_dir)
            # Memory-mapped from the dataset's index cache: no per-rank array that grows with the corpus.
            self.index_N = load_or_build_sentence_index(self.source)
        elif p.is_file():  # a small corpus (wiki1m: 1e6 lines); a large one is preprocessed into shards first
            self.lines = _read_lines(str(p))
            self.index_N = np.arange(len(self.lines), dtype=np.int64)
        else:
            raise FileNotFoundError(f"data.sentences={path} does not exist; give a one-sentence-per-line text file "
                                    "or a pretrain-preprocess dataset directory")

    def __len__(self) -> int:
        return len(self.index_N)

    @property
    def data_identity(self) -> str | None:
        """What this training set is (``datasets.data_identity``): a preprocessed directory's manifest, or the text
        (or pairs) file's bytes (hashed once, on first use), and its number of sentences; None for other inputs."""
        if self.source is not None:
            return f"sentences of shards {self.source.manifest_digest}, {len(self)}"
        if not Path(self.path).is_file():
            return None
        if self._file_digest is None:
            import hashlib

            h = hashlib.sha256()
            with open(self.path, "rb") as f:
                for block in iter(lambda: f.read(1 << 20), b""):
                    h.update(block)
            self._file_digest = h.hexdigest()[:20]
        return f"sentences of file {self._file_digest}, {len(self)}"

    def tokens(self, index: int) -> np.ndarray:
        """Token ids (int64, no specials, not truncated) of sentence ``index``."""
        i = int(self.index_N[index])
        if self.lines is not None:
            return np.asarray(self.tokenizer.encode(self.lines[i]), dtype=np.int64)
        return np.asarray(self.source[i], dtype=np.int64)

    def __getitem__(self, key) -> dict:
        """key = (epoch, index) or index; index >= len reuses sentence index % len with fresh noise."""
        epoch, index = parse_key(key)
        n = len(self)
        if index < 0:
            raise IndexError(f"sample index {index} out of range for {n} sentences")
        ids_T = self.tokens(index % n)
        rng_mask, rng_triplet = np.random.default_rng([self.seed, epoch, index]).spawn(2)
        sentence_T = self.wrap(ids_T[: self.cfg.view_max_len - 2])
        sample = {"sentence": sentence_T}
        if self.mlm:
            sample["input_ids"], sample["mlm_labels"] = mask_tokens(
                sentence_T, rng_mask, self.cfg.masking, vocab_size=self.vocab_size,
                special_ids=self.special_ids, mask_id=self.mask_id)
        if self.triplet is not None:
            sample.update(self.triplet_views(ids_T, rng_triplet))
        return sample

    def triplet_views(self, ids_T: np.ndarray, rng: np.random.Generator) -> dict:
        """{has_triplet, triplet_anchor, triplet_low, triplet_high} (wrapped, equal lengths); short sentences
        (< min_words words) get only has_triplet=False."""
        t = self.triplet
        ids_T = ids_T[: t.max_len - 2]
        starts_W = np.flatnonzero(self._word_start[ids_T]) if len(ids_T) else np.zeros(0, np.int64)
        if len(starts_W) and starts_W[0] != 0:  # a leading continuation piece belongs to the first word
            starts_W = np.concatenate([[0], starts_W])
        views = build_triplet_views(ids_T, rng, word_starts=starts_W, low=t.low, high=t.high,
                                    min_words=t.min_words, mask_id=self.mask_id, max_segments=t.max_segments)
        if views is None:
            return {"has_triplet": False}
        return {"has_triplet": True, "triplet_anchor": self.wrap(ids_T), "triplet_low": self.wrap(views[0]),
                "triplet_high": self.wrap(views[1])}

    def wrap(self, tokens_T: np.ndarray) -> np.ndarray:
        return with_cls_sep(tokens_T, self.cls_id, self.sep_id)

    def token_frequencies(self) -> np.ndarray:
        """float64 [V] unigram frequencies over all sentences (sums to 1): SARCSE's freq(w)."""
        if self.source is not None:
            stored = self.source.token_frequencies()
            if stored is not None:
                return stored
        counts_V = np.zeros(self.vocab_size, dtype=np.int64)
        chunk = 4096
        for start in range(0, len(self), chunk):
            if self.lines is not None:
                batch = self.tokenizer.encode_batch([self.lines[i] for i in self.index_N[start:start + chunk]])
                flat = np.fromiter((t for ids in batch for t in ids), dtype=np.int64)
            else:
                flat = np.concatenate([self.tokens(i) for i in range(start, min(start + chunk, len(self)))])
            counts_V += np.bincount(flat, minlength=self.vocab_size)[: self.vocab_size]
        return counts_V / max(int(counts_V.sum()), 1)


class PairDataset(SentenceDataset):
    """``SentenceDataset`` over the anchors, each sample also carrying its ``positive`` and ``negative`` (wrapped,
    cut to data.view_max_len like the anchor)."""

    def _open(self, path: str, tokenizer) -> None:
        self.pairs = read_pairs(path)
        self.lines = self.pairs.anchor
        self.index_N = np.arange(len(self.lines), dtype=np.int64)

    @property
    def has_negatives(self) -> bool:
        return self.pairs.negative is not None

    def __getitem__(self, key) -> dict:
        sample = super().__getitem__(key)
        i = int(self.index_N[parse_key(key)[1] % len(self)])
        sample["positive"] = self._wrapped(self.pairs.positive[i])
        if self.pairs.negative is not None:
            sample["negative"] = self._wrapped(self.pairs.negative[i])
        return sample

    def _wrapped(self, text: str) -> np.ndarray:
        ids_T = np.asarray(self.tokenizer.encode(text), dtype=np.int64)
        return self.wrap(ids_T[: self.cfg.view_max_len - 2])


def build_sentence_dataset(cfg: DataConfig, objective: ObjectiveConfig, tokenizer, *, seed: int) -> SentenceDataset:
    """The sentence stage's dataset: data.pairs' rows (pretrain/data/pairs.py) or data.sentences' sentences."""
    if cfg.stage != "sentences":
        raise ValueError(f"build_sentence_dataset needs data.stage=sentences, got {cfg.stage!r}")
    if cfg.pairs:
        return PairDataset(cfg.pairs, tokenizer, cfg, objective, seed=seed)
    return SentenceDataset(cfg.sentences, tokenizer, cfg, objective, seed=seed)


# ----------------------------------------------------------------------------- batches


def collate_sentences(samples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """SentenceDataset samples -> the batch dict documented at the top of this module."""
    if not samples:
        raise ValueError("collate_sentences got an empty list of samples")
    batch: dict[str, torch.Tensor] = {}
    batch["sentence_ids"], batch["sentence_mask"] = pad_stack([s["sentence"] for s in samples], pad_id)
    if "input_ids" in samples[0]:
        batch["input_ids"], batch["attention_mask"] = pad_stack([s["input_ids"] for s in samples], pad_id)
        batch["mlm_labels"], _ = pad_stack([s["mlm_labels"] for s in samples], IGNORE_INDEX)
    else:
        batch["input_ids"], batch["attention_mask"] = batch["sentence_ids"], batch["sentence_mask"]
    for key in PAIR_KEYS:
        if key in samples[0]:
            batch[f"{key}_ids"], batch[f"{key}_mask"] = pad_stack([s[key] for s in samples], pad_id)
    if "has_triplet" in samples[0]:
        with_triplet = [b for b, s in enumerate(samples) if s["has_triplet"]]
        batch["triplet_index"] = torch.tensor(with_triplet, dtype=torch.int64)
        # All three views share one padded length so the triplet branch runs as one forward pass.
        seqs = [samples[b][k] for k in TRIPLET_KEYS for b in with_triplet]
        ids, mask = pad_stack(seqs, pad_id)
        num = len(with_triplet)
        for j, key in enumerate(TRIPLET_KEYS):
            batch[f"{key}_ids"], batch[f"{key}_mask"] = ids[j * num:(j + 1) * num], mask[j * num:(j + 1) * num]
    return batch


def build_sentence_loader(dataset, **kwargs) -> ResumableLoader:
    """pretrain.data.loader.build_loader (same sample order and resume rule) with collate_sentences."""
    return build_loader(dataset, collate_fn=collate_sentences, **kwargs)


def _read_lines(path: str) -> list[str]:
    """The non-empty stripped lines of a text file, plain or compressed (gzip, zstd, bzip2, xz); ValueError for a
    binary, columnar or truncated file, saying what it is."""
    import io


    try:
        container = identify(path)
    except ValueError as e:
        raise ValueError(f"data.sentences: {e}") from None
    if container.columnar:
        raise ValueError(f"data.sentences={path} is a {container.columnar} file; preprocess it first "
                         f"(pretrain-preprocess {path} --tokenizer ... --out DIR) and give DIR")
    # utf-8-sig: a file's BOM is dropped, not made part of the first sentence (as the preprocessing readers do).
    with io.TextIOWrapper(open_stream(path, container.compression), encoding="utf-8-sig", errors="replace") as f:
        try:
            return [s for s in (line.strip() for line in f) if s]
        except STREAM_ERRORS as e:
            raise stream_error(path, container.compression, e) from None
