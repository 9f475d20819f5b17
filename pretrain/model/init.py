"""BERT's weight initialisation: normal(0, std) weights, zero biases, LayerNorm 1/0."""

from __future__ import annotations

import torch
from torch import nn


def init_bert_weights(module: nn.Module, std: float, generator: torch.Generator | None = None) -> None:
    """Initialise ``module`` and all submodules in place, as BERT does.

    Linear/Embedding weights ~ N(0, std), every bias 0, LayerNorm weight 1 and bias 0.
    A tied parameter is drawn once (through its first owner).
    """
    seen: set[int] = set()

    def fresh(p: torch.Tensor | None) -> bool:
        if p is None or id(p) in seen:
            return False
        seen.add(id(p))
        return True

    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                if fresh(m.weight):
                    nn.init.normal_(m.weight, mean=0.0, std=std, generator=generator)
                if getattr(m, "bias", None) is not None and fresh(m.bias):
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                if fresh(m.weight):
                    nn.init.ones_(m.weight)
                if fresh(m.bias):
                    nn.init.zeros_(m.bias)
            else:  # a bias a module owns directly (the MLM output bias) starts at zero too
                bias = m._parameters.get("bias")
                if bias is not None and fresh(bias):
                    nn.init.zeros_(bias)
