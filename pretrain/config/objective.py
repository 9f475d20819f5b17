"""Objective configuration: which loss terms, with which weights and hyperparameters."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Literal


@dataclass(kw_only=True)
class MLMConfig:
    weight: float = 1.0


@dataclass(kw_only=True)
class NTXentConfig:
    """CLEAR's NT-Xent over the 2N augmented views of a batch."""

    weight: float = 1.0
    temperature: float = 0.1
    """CLEAR's tau. The CLEAR paper does not state it (Sec. 3.1 defines tau only); 0.1 is this code's default."""
    gather: bool = True
    """Use negatives from all data-parallel ranks (gathered with gradient)."""
    mean_pool_warmup_steps: int = 0
    """Remedy for the [CLS] collapse at BERT's initialisation (README, 'When the contrastive loss sits at
    chance'): for the first K steps the views' embedding blends mean pooling into model.pooling, with weight
    1 - step/K on the mean, so the contrastive gradient is not near zero while [CLS] is still input-independent;
    from step K on it is model.pooling alone (evaluation and exported models never blend: eval.pooling, else
    model.pooling).
    0 = off (CLEAR's recipe)."""

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"objective.nt_xent.temperature must be > 0, got {self.temperature}")
        if self.mean_pool_warmup_steps < 0:
            raise ValueError(f"objective.nt_xent.mean_pool_warmup_steps must be >= 0 (0 = off), got "
                             f"{self.mean_pool_warmup_steps}")


@dataclass(kw_only=True)
class InfoNCEConfig:
    """SimCSE-style InfoNCE between two dropout views: row i of view 1 vs all rows of view 2."""

    weight: float = 1.0
    """SARCSE's alpha; 1 elsewhere."""
    temperature: float = 0.05
    gather: bool = True
    """Use view-2 negatives from all data-parallel ranks (gathered with gradient; hard negatives too)."""
    hard_negative_weight: float = 1.0
    """Supervised SimCSE (data.pairs with a third column): each row's own hard negative enters the softmax
    denominator with its exp weighted by alpha (SimCSE, Gao et al. 2021, App. "hard negative weighting": alpha = 1,
    no reweighting, was best and is the paper's setting; the official code's hard_negative_weight is log alpha).
    Every other row's hard negative is a plain negative. >= 0 (0 leaves out each row's own)."""

    def __post_init__(self) -> None:
        _check_positive("objective.info_nce.temperature", self.temperature)
        _check_non_negative("objective.info_nce.hard_negative_weight", self.hard_negative_weight)


@dataclass(kw_only=True)
class ArcConConfig:
    """ArcCSE's additive-angular-margin InfoNCE: positive logit cos(theta + m) / tau."""

    weight: float = 1.0
    temperature: float = 0.05
    margin_deg: float = 10.0
    """Angular margin m in degrees (paper: 10)."""
    gather: bool = True
    hard_negative_weight: float = 1.0
    """Each row's own hard negative's weight alpha, as objective.info_nce.hard_negative_weight (data.pairs with
    a third column); 1 = no reweighting."""

    def __post_init__(self) -> None:
        _check_positive("objective.arccon.temperature", self.temperature)
        _check_non_negative("objective.arccon.hard_negative_weight", self.hard_negative_weight)
        if not 0.0 <= self.margin_deg < 90.0:
            raise ValueError(f"objective.arccon.margin_deg must be in [0, 90), got {self.margin_deg}")


@dataclass(kw_only=True)
class TripletConfig:
    """ArcCSE's triplet entailment loss on (s, s' 20% masked, s'' 40% masked), dropout off."""

    weight: float = 0.1
    """ArcCSE's lambda."""
    margin: float = 0.0
    low: float = 0.2
    """Fraction of words masked in s' (contiguous segments)."""
    high: float = 0.4
    """Fraction of words masked in s'' (a superset of s''s mask)."""
    min_words: int = 25
    """Sentences with fewer words get no triplet."""
    max_segments: int = 2
    """s' masks between 1 and this many contiguous word segments."""
    max_len: int = 128
    """Tokens per triplet view including [CLS]/[SEP] (the ArcCon views use data.view_max_len)."""

    def __post_init__(self) -> None:
        if not 0.0 < self.low < self.high < 1.0:
            raise ValueError(f"objective.triplet needs 0 < low < high < 1, got low={self.low} high={self.high}")
        if self.min_words < 2 or self.max_segments < 1 or self.max_len < 8:
            raise ValueError(
                "objective.triplet.min_words must be >= 2, max_segments >= 1 and max_len >= 8, got "
                f"{self.min_words}/{self.max_segments}/{self.max_len}"
            )


@dataclass(kw_only=True)
class ConsistencyConfig:
    """RankCSE ranking consistency: JS(softmax(S/tau1) || softmax(S'/tau1)) of the two dropout views."""

    weight: float = 1.0
    """RankCSE's beta."""
    temperature: float = 0.05
    """tau1."""

    def __post_init__(self) -> None:
        _check_positive("objective.consistency.temperature", self.temperature)


@dataclass(kw_only=True)
class RankDistillConfig:
    """RankCSE ranking distillation from frozen teachers (ListNet or ListMLE)."""

    weight: float = 1.0
    """RankCSE's gamma."""
    method: Literal["listnet", "listmle"] = "listnet"
    student_temperature: float = 0.025
    """tau2."""
    teacher_temperature: float = 0.0125
    """tau3 (ListNet only)."""
    teachers: list[str] = field(default_factory=list)
    """Teacher checkpoints (ours or HF model directories); their similarity lists are mixed by teacher_weights."""
    teacher_weights: list[float] = field(default_factory=list)
    """Mixing weights (alpha, 1 - alpha); empty = equal weights."""
    teacher_pooling: Literal["cls", "mean", "cls_before_pooler", "first_last_avg"] = "cls_before_pooler"
    teacher_max_len: int = 32
    exclude_positive: bool = True
    """Drop the positive pair from the lists (RankCSE footnote 1 for ListNet)."""

    def __post_init__(self) -> None:
        _check_positive("objective.rank_distill.student_temperature", self.student_temperature)
        _check_positive("objective.rank_distill.teacher_temperature", self.teacher_temperature)
        if self.teacher_weights:
            if len(self.teacher_weights) != len(self.teachers):
                raise ValueError(
                    f"objective.rank_distill.teacher_weights has {len(self.teacher_weights)} entries for "
                    f"{len(self.teachers)} teachers; give one weight per teacher or leave it empty"
                )
            if any(w < 0 for w in self.teacher_weights) or abs(sum(self.teacher_weights) - 1.0) > 1e-6:
                raise ValueError(
                    f"objective.rank_distill.teacher_weights must be >= 0 and sum to 1, got {self.teacher_weights}"
                )

    def mixing_weights(self) -> list[float]:
        n = len(self.teachers)
        return list(self.teacher_weights) if self.teacher_weights else [1.0 / n] * n


@dataclass(kw_only=True)
class ReconstructionConfig:
    """SARCSE: TextCNN autoencoder over token states + self-adaptive (frequency-weighted) reconstruction."""

    weight: float = 2.5e-4
    """beta, on L_R (first dropout view)."""
    positive_weight: float = 2.5e-4
    """gamma, on L_R+ (second dropout view)."""
    theta: float = 0.1
    """Floor of the token weight f(w) = max(theta, 1 - lam * freq(w))."""
    lam: float = 50.0
    token_freq: str = ""
    """token_freq.npy (float64 [vocab], sums to 1); empty = token_freq.npy of the first data source."""
    kernel_sizes: tuple[int, ...] = (3, 4, 5)
    channels: int = 500
    """co_t: output channels of each TextCNN."""
    integrate_channels: int = 3
    """co_c: output channels of the integrating CNN; Z has co_c * (co_t - 1) dims."""
    detach_target: bool = False
    """Stop gradients through the reconstruction target (the encoder's token states)."""

    def __post_init__(self) -> None:
        if self.weight < 0 or self.positive_weight < 0:
            raise ValueError("objective.reconstruction.weight and positive_weight must be >= 0")
        if not 0.0 <= self.theta <= 1.0 or self.lam < 0:
            raise ValueError(f"objective.reconstruction needs theta in [0, 1] and lam >= 0, got {self.theta}/{self.lam}")
        if not self.kernel_sizes or min(self.kernel_sizes) < 1 or self.channels < 2 or self.integrate_channels < 1:
            raise ValueError(
                "objective.reconstruction needs kernel_sizes >= 1, channels >= 2 and integrate_channels >= 1"
            )


@dataclass(kw_only=True)
class MatryoshkaConfig:
    """Matryoshka representation learning (Kusupati et al. 2022): every contrastive term (nt_xent, info_nce,
    arccon, consistency, rank_distill) applied at several truncated sizes of the sentence embedding, weighted."""

    dims: list[int] = field(default_factory=list)
    """Embedding sizes d: the term sees the projection of the sentence embedding's first d coordinates (the rest
    zeroed), so the first d coordinates alone make an embedding (sentence-transformers' truncate_dim=d). List the
    full size too to keep the untruncated term (e.g. [768, 512, 256, 128, 64]); each d <= the embedding size."""
    weights: list[float] = field(default_factory=list)
    """One weight per size (loss = sum_d w_d * term at d); empty = 1 each (sentence-transformers' default)."""

    def __post_init__(self) -> None:
        if not self.dims or any(int(d) < 1 for d in self.dims) or len(set(self.dims)) != len(self.dims):
            raise ValueError(f"objective.matryoshka.dims must be distinct sizes >= 1, got {self.dims}")
        if self.weights and (len(self.weights) != len(self.dims) or any(not w > 0 for w in self.weights)):
            raise ValueError(f"objective.matryoshka.weights must be one weight > 0 per size of dims {self.dims}, "
                             f"got {self.weights}")

    def sizes(self) -> list[tuple[int, float]]:
        """(d, w_d) per size, largest first."""
        weights = self.weights or [1.0] * len(self.dims)
        return sorted(zip(map(int, self.dims), map(float, weights)), key=lambda x: -x[0])


@dataclass(kw_only=True)
class ObjectiveConfig:
    mlm: MLMConfig | None = field(default_factory=MLMConfig)
    """Masked language modelling; null disables it."""
    nt_xent: NTXentConfig | None = field(default_factory=NTXentConfig)
    """CLEAR contrastive loss on augmented views; null disables it."""
    info_nce: InfoNCEConfig | None = None
    """SimCSE InfoNCE on two dropout views (SimCSE, RankCSE, SARCSE)."""
    arccon: ArcConConfig | None = None
    """ArcCSE ArcCon loss on two dropout views."""
    triplet: TripletConfig | None = None
    """ArcCSE triplet entailment loss."""
    consistency: ConsistencyConfig | None = None
    """RankCSE ranking consistency."""
    rank_distill: RankDistillConfig | None = None
    """RankCSE ranking distillation."""
    reconstruction: ReconstructionConfig | None = None
    """SARCSE autoencoder reconstruction (its Z is the sentence embedding fed to info_nce)."""
    gradient_cache: bool = False
    """The contrastive batch is the whole optimizer step: train.micro_batch_size x train.grad_accum x ranks
    sentences see each other as negatives, and train.micro_batch_size is only the chunk held in memory
    (GradCache, Gao et al. 2021: every chunk embedded without a graph, the contrastive terms' gradient taken with
    respect to the embeddings, then each chunk re-run with a graph, its dropout replayed, and the cached
    gradient back-propagated; objective/grad_cache.py). Costs one extra forward of the pair per step. Off: each
    micro-step's contrastive terms see only its own micro-batch (x ranks)."""
    matryoshka: MatryoshkaConfig | None = None
    """Apply every contrastive term at several truncated embedding sizes (objective/matryoshka.py); null = off."""

    def enabled(self) -> list[str]:
        """Names of the configured (non-null) loss terms, in declaration order."""
        return [f.name for f in dataclasses.fields(self)
                if f.name not in SETTINGS and getattr(self, f.name) is not None]

    def __post_init__(self) -> None:
        if not self.enabled():
            raise ValueError(
                "objective: no loss term is enabled; set at least one of "
                + ", ".join(f"objective.{f.name}" for f in dataclasses.fields(self) if f.name not in SETTINGS)
            )
        if self.rank_distill is not None and not self.rank_distill.teachers:
            raise ValueError("objective.rank_distill.teachers is empty; list one or more teacher checkpoints")
        if self.matryoshka is not None and self.reconstruction is not None:
            raise ValueError("objective.matryoshka truncates the pooled sentence embedding; with "
                             "objective.reconstruction the terms compare the autoencoder's Z instead: use one of them")
        for name in ("consistency", "rank_distill", "reconstruction"):
            if getattr(self, name) is not None and self.info_nce is None and self.arccon is None:
                raise ValueError(
                    f"objective.{name} works on the two dropout views; enable objective.info_nce or objective.arccon too"
                )


SETTINGS = frozenset({"gradient_cache", "matryoshka"})
"""Fields of ObjectiveConfig that are settings of the whole objective, not loss terms."""


def _check_positive(path: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{path} must be > 0, got {value}")


def _check_non_negative(path: str, value: float) -> None:
    if not value >= 0:
        raise ValueError(f"{path} must be >= 0, got {value}")
