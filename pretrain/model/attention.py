"""Multi-head self-attention over SDPA with a boolean padding mask.

Shapes: B batch, T sequence length, D hidden size, H heads, K head size (D = H*K).
Masks: keep_B11T is True where a key position is a real token (may be attended to).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config.model import ModelConfig


class SelfAttention(nn.Module):
    """Separate q/k/v projections (one-to-one with BERT's keys), SDPA, output projection."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_heads
        self.head_size = d // cfg.num_heads
        self.q = nn.Linear(d, d)
        self.k = nn.Linear(d, d)
        self.v = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.attention_dropout = cfg.attention_dropout

    def forward(self, x_BTD: torch.Tensor, keep_B11T: torch.Tensor | None) -> torch.Tensor:
        """x_BTD -> y_BTD (before the output dropout and residual)."""
        b, t, d = x_BTD.shape
        q_BHTK = self.q(x_BTD).view(b, t, self.num_heads, self.head_size).transpose(1, 2)
        k_BHTK = self.k(x_BTD).view(b, t, self.num_heads, self.head_size).transpose(1, 2)
        v_BHTK = self.v(x_BTD).view(b, t, self.num_heads, self.head_size).transpose(1, 2)
        y_BHTK = F.scaled_dot_product_attention(
            q_BHTK,
            k_BHTK,
            v_BHTK,
            attn_mask=keep_B11T,
            dropout_p=self.attention_dropout if self.training else 0.0,
        )
        y_BTD = y_BHTK.transpose(1, 2).reshape(b, t, d)
        return self.out(y_BTD)
