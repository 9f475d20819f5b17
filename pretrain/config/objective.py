"""Objective configuration: which loss terms, with which weights and hyperparameters."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class MLMConfig:
    weight: float = 1.0


@dataclass(kw_only=True)
class NTXentConfig:
    """CLEAR's NT-Xent over the 2N augmented views of a batch."""

    weight: float = 1.0
    temperature: float = 0.1
    """CLEAR's tau (paper: 0.1)."""
    gather: bool = True
    """Use negatives from all data-parallel ranks (gathered with gradient)."""

    def __post_init__(self) -> None:
        if self.temperature <= 0:
            raise ValueError(f"objective.nt_xent.temperature must be > 0, got {self.temperature}")


@dataclass(kw_only=True)
class ObjectiveConfig:
    mlm: MLMConfig | None = field(default_factory=MLMConfig)
    """Masked language modelling; null disables it."""
    nt_xent: NTXentConfig | None = field(default_factory=NTXentConfig)
    """CLEAR contrastive loss on augmented views; null disables it."""

    def enabled(self) -> list[str]:
        """Names of the configured (non-null) loss terms, in declaration order."""
        return [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]

    def __post_init__(self) -> None:
        if not self.enabled():
            raise ValueError("objective: no loss term is enabled; set at least objective.mlm or objective.nt_xent")
