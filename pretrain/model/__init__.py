"""The encoder model and its heads."""

from pretrain.model.encoder import Encoder
from pretrain.model.heads import (
    POOLINGS,
    MLMHead,
    Pooler,
    ProjectionHead,
    SentenceDense,
    masked_mean,
    pool,
)
from pretrain.model.model import IGNORE_INDEX, TIED_KEYS, PretrainModel, build_model

__all__ = [
    "Encoder",
    "IGNORE_INDEX",
    "MLMHead",
    "POOLINGS",
    "Pooler",
    "PretrainModel",
    "ProjectionHead",
    "SentenceDense",
    "TIED_KEYS",
    "build_model",
    "masked_mean",
    "pool",
]
