"""One Transformer encoder layer: self-attention + feed-forward, post-LN (BERT) or pre-LN.

Shapes: B batch, T sequence length, D hidden size, F feed-forward size; unpadded (``packed``), x_ND of N
packed tokens takes x_BTD's place (everything but attention is per token).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config.model import ModelConfig
from pretrain.model.attention import SelfAttention
from pretrain.model.dropout import Dropout
from pretrain.model.flat import forget_traced_views, materialize
from pretrain.model.packing import Packed, take_rows


GELU_FORMS = {"gelu": "none", "gelu_tanh": "tanh"}
"""The ModelConfig.activation names that are GELU, with ``F.gelu``'s ``approximate`` for each."""


def activation_fn(name: str):
    """Name from ModelConfig.activation -> elementwise function (``gelu`` is the exact erf form)."""
    if name == "gelu":
        return F.gelu
    if name in GELU_FORMS:
        return lambda x: F.gelu(x, approximate=GELU_FORMS[name])
    if name == "relu":
        return F.relu
    raise ValueError(f"model.activation must be one of gelu, gelu_tanh, relu; got {name!r}")


class FeedForward(nn.Module):
    """x_BTD -> down(act(up(x))), without the output dropout."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.ffn_size)
        self.down = nn.Linear(cfg.ffn_size, cfg.hidden_size)
        self.act = activation_fn(cfg.activation)

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x_BTD)))


class Block(nn.Module):
    """post-LN: x = LN(x + drop(attn(x))); x = LN(x + drop(ffn(x))).
    pre-LN:  x = x + drop(attn(LN(x)));  x = x + drop(ffn(LN(x)))  (the encoder adds a final LN).
    """

    FLAT_SPANS = {"attn.qkv_span": (("attn.q.weight", "attn.k.weight", "attn.v.weight"),
                                    ("attn.q.bias", "attn.k.bias", "attn.v.bias"))}
    """Flattened (model/flat.py), q/k/v's weights and biases lie end to end: attention projects with one matmul."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.pre_norm = cfg.norm == "pre"
        self.attn = SelfAttention(cfg)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.ffn = FeedForward(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x_BTD: torch.Tensor, keep_B11T: torch.Tensor | None,
                packed: Packed | None = None, rows_S: torch.Tensor | None = None) -> torch.Tensor:
        """x_BTD (x_ND with ``packed``) -> the layer's output; with ``rows_S`` x_SD, only those tokens' (keys,
        values and attention from all; the output projection, the FFN and the norms then run on S rows)."""
        materialize(self)  # a flattened layer's parameter views (model/flat.py)
        x_SD = take_rows(x_BTD, rows_S)  # x_BTD itself without rows_S
        if self.pre_norm:
            x_SD = x_SD + self.dropout(self.attn(self.attn_norm(x_BTD), keep_B11T, packed, rows_S))
            x_SD = x_SD + self.dropout(self.ffn(self.ffn_norm(x_SD)))
        else:
            x_SD = self.attn_norm(x_SD + self.dropout(self.attn(x_BTD, keep_B11T, packed, rows_S)))
            x_SD = self.ffn_norm(x_SD + self.dropout(self.ffn(x_SD)))
        forget_traced_views(self)
        return x_SD
