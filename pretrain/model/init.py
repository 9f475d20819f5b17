"""Weight initialisation: BERT's (normal(0, std) weights, zero biases, LayerNorm 1/0) and ModernBERT's."""

from __future__ import annotations

import math

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


def init_modern_weights(model: nn.Module, std: float, num_layers: int,
                        generator: torch.Generator | None = None) -> None:
    """ModernBERT's initialisation (transformers' ``ModernBertPreTrainedModel._init_weights``) of a PretrainModel:
    BERT's first (norms 1, biases 0, the heads ModernBERT lacks), then every encoder weight and the MLM head's dense
    from a normal truncated at +-2 std; the layers writing into the residual stream (attention output, GeGLU's wo)
    and the MLM head's dense at std / sqrt(2 * num_layers), so that the residual stream does not grow with depth."""
    init_bert_weights(model, std, generator=generator)
    out_std = std / math.sqrt(2.0 * num_layers)

    def draw(weight: torch.Tensor, s: float) -> None:
        nn.init.trunc_normal_(weight, mean=0.0, std=s, a=-2.0 * s, b=2.0 * s, generator=generator)

    with torch.no_grad():
        draw(model.encoder.embeddings.word.weight, std)
        for layer in model.encoder.layers:
            draw(layer.attn.qkv.weight, std)
            draw(layer.ffn.wi.weight, std)
            draw(layer.attn.out.weight, out_std)
            draw(layer.ffn.wo.weight, out_std)
        draw(model.mlm_head.dense.weight, out_std)
