"""Data configuration: tokenizer, sources, samples, masking and augmentation."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

IGNORE_INDEX = -100
"""Label of positions that are not predicted (PyTorch cross-entropy's ignore_index); data and model share it."""


@dataclass(kw_only=True)
class SourceConfig:
    name: str
    """Label used in metrics (e.g. wiki, books)."""
    path: str
    """Dataset directory written by pretrain-preprocess (holds manifest.json)."""
    weight: float = 1.0
    """Relative sampling weight when several sources are blended."""

    def __post_init__(self) -> None:
        if self.weight <= 0:
            raise ValueError(f"data.sources[{self.name}].weight must be > 0, got {self.weight}")


@dataclass(kw_only=True)
class MaskingConfig:
    prob: float = 0.15
    """Fraction of (non-special) tokens selected for MLM prediction."""
    mask_frac: float = 0.8
    """Of the selected tokens: replaced by [MASK]."""
    random_frac: float = 0.1
    """Of the selected tokens: replaced by a random token (the rest stay unchanged)."""
    scheme: Literal["token", "whole_word", "span"] = "token"
    """What is selected: single tokens (BERT); whole words, prob of the words with all their sub-tokens (BERT's
    whole-word masking; 80/10/10 per token); or spans of whole words of geometric length until prob of the
    tokens are selected, the 80/10/10 choice made once per span (SpanBERT)."""
    span_p: float = 0.2
    """scheme=span: span lengths in words follow Geometric(span_p) truncated to 1..span_max (SpanBERT: 0.2)."""
    span_max: int = 10
    """scheme=span: the longest span in words (SpanBERT: 10; mean length 3.8 with span_p=0.2)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.prob < 1.0:
            raise ValueError(f"data.masking.prob must be in (0, 1), got {self.prob}")
        if self.scheme not in ("token", "whole_word", "span"):
            raise ValueError(f"data.masking.scheme must be 'token', 'whole_word' or 'span', got {self.scheme!r}")
        if not 0.0 < self.span_p <= 1.0:
            raise ValueError(f"data.masking.span_p must be in (0, 1], got {self.span_p}")
        if self.span_max < 1:
            raise ValueError(f"data.masking.span_max must be >= 1, got {self.span_max}")
        if self.mask_frac < 0 or self.random_frac < 0 or self.mask_frac + self.random_frac > 1.0:
            raise ValueError(
                f"data.masking.mask_frac + random_frac must be <= 1, got {self.mask_frac} + {self.random_frac}"
            )


@dataclass(kw_only=True)
class AugmentConfig:
    methods: str = "del-span+reorder"
    """CLEAR augmentation(s), '+'-joined, applied in order: del-word, del-span, reorder, subs."""
    del_word_rate: float = 0.7
    del_span_num: int = 5
    del_span_frac: float = 0.05
    reorder_pairs: int = 5
    reorder_frac: float = 0.05
    subs_rate: float = 0.3
    wordnet_dir: str = "/usr/share/wordnet"
    """WordNet database directory (Debian's wordnet-base) for synonym substitution."""

    def __post_init__(self) -> None:
        for name in ("del_word_rate", "del_span_frac", "reorder_frac", "subs_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"data.augment.{name} must be in [0, 1], got {value}")
        if self.del_span_num < 0 or self.reorder_pairs < 0:
            raise ValueError(
                f"data.augment.del_span_num/reorder_pairs must be >= 0, got {self.del_span_num}/{self.reorder_pairs}"
            )


@dataclass(kw_only=True)
class DataConfig:
    tokenizer: str = ""
    """Path to the tokenizer file written by pretrain-tokenizer."""
    sources: list[SourceConfig] = field(default_factory=list)
    valid: list[SourceConfig] = field(default_factory=list)
    """Held-out datasets for periodic validation (same format as sources)."""
    max_len: int = 128
    """Tokens per MLM sequence including [CLS] and [SEP]."""
    view_max_len: int = 128
    """Tokens per contrastive view including [CLS] and [SEP]."""
    num_workers: int = 1
    """DataLoader worker processes building samples (masking + augmentation)."""
    prefetch_factor: int = 4
    timeout_s: float = 600.0
    """How long the trainer waits for its next batch from the workers (num_workers > 0) before it stops with exit 5,
    naming the stuck workers (a read from a hung filesystem mount never returns: without it a one-rank run hangs
    for good); 0 = wait forever. Raise it if building a batch can really take that long."""
    index_cache_dir: str = ""
    """Where the datasets' index caches (sample index, sentence index, shard-check stamps) are kept: "" = each
    dataset's own ``index-cache/``. Set it when the dataset directories are read-only (a shared project space):
    otherwise every rank builds its indexes in RAM (8 bytes a sample or sentence, per rank). Files are named by
    the dataset's manifest digest, so one directory can serve many datasets and runs; ranks sharing it must see
    the same filesystem."""
    packing: Literal["document", "full"] = "document"
    """Which sentences make an MLM sample: contiguous sentences of one document up to max_len (document), or
    contiguous sentences across documents filling max_len, a [SEP] between two documents (full: RoBERTa's
    FULL-SENTENCES; more real tokens per step). The CLEAR views are built from the same packed text."""
    masking: MaskingConfig = field(default_factory=MaskingConfig)
    augment: AugmentConfig = field(default_factory=AugmentConfig)
    stage: Literal["pretrain", "sentences"] = "pretrain"
    """pretrain: MLM + CLEAR samples from data.sources; sentences: the seed-objective sentence stage
    (continued training on data.sentences, see pretrain/data/sentences.py)."""
    sentences: str = ""
    """Sentence stage input: a text file with one sentence per line, or a pretrain-preprocess dataset
    directory whose sequences are single sentences. Sentences are cut to view_max_len tokens."""
    pairs: str = ""
    """Sentence stage input instead of data.sentences: (anchor, positive[, hard negative]) rows for supervised
    SimCSE, a .tsv/.csv file (2 or 3 columns; an optional header row such as anchor/positive/negative or SimCSE's
    sent0/sent1/hard_neg) or a .jsonl file ({"anchor": .., "positive": .., "negative": ..} or a 2-3 string list);
    gzip etc. compressed too. All rows have the same columns. The pair is (anchor, positive) instead of one
    sentence twice; hard negatives are extra InfoNCE/ArcCon columns (pretrain/data/pairs.py)."""

    def __post_init__(self) -> None:
        if self.stage == "sentences" and not self.sentences and not self.pairs:
            raise ValueError("data.stage=sentences needs data.sentences: a one-sentence-per-line text file "
                             "(or a pretrain-preprocess directory of single sentences), or data.pairs: a tsv/csv/jsonl "
                             "file of (anchor, positive[, hard negative]) rows")
        if self.sentences and self.pairs:
            raise ValueError(f"data.sentences={self.sentences!r} and data.pairs={self.pairs!r} are both set; the "
                             "sentence stage trains on one of them: set the other to ''")
        if self.max_len < 8 or self.view_max_len < 8:
            raise ValueError(f"data.max_len/view_max_len must be >= 8, got {self.max_len}/{self.view_max_len}")
        if self.num_workers < 0:
            raise ValueError(f"data.num_workers must be >= 0, got {self.num_workers}")
        if not self.timeout_s >= 0:
            raise ValueError(f"data.timeout_s must be >= 0 (0 = wait forever), got {self.timeout_s}")
        names = [s.name for s in self.sources]
        if len(set(names)) != len(names):
            raise ValueError(f"data.sources names must be unique, got {names}")
