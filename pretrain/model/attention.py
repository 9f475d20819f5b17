"""Multi-head self-attention over SDPA: padded (a boolean padding mask) or unpadded (packing.py's groups, or
its varlen layout: nested jagged tensors).

Shapes: B batch, T sequence length, D hidden size, H heads, K head size (D = H*K), N packed tokens,
n rows and t length of an attention group, P attention slots of all groups.
Masks: keep_B11T is True where a key position is a real token (may be attended to).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config.model import ModelConfig
from pretrain.model.dropout import attention
from pretrain.model.gather import gather_slots, group_heads
from pretrain.model.packing import Packed, take_rows


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
        self.fast_dropout = True
        """Attention dropout on the CPU with model/dropout.py's masks (train.fast_dropout)."""
        self.qkv_span: tuple[torch.Tensor, torch.Tensor] | None = None
        """q/k/v's weights and biases as one (3D, D) weight and (3D,) bias: views that a flattened layer
        (model/flat.py, Block.FLAT_SPANS) sets at each forward, so the three projections are one matmul."""

    def forward(self, x_BTD: torch.Tensor, keep_B11T: torch.Tensor | None,
                packed: Packed | None = None, rows_S: torch.Tensor | None = None) -> torch.Tensor:
        """x_BTD -> y_BTD (before the output dropout and residual); with ``packed``, x_ND -> y_ND; with ``rows_S``
        y_SD of those tokens only (``packing.take_rows``)."""
        if packed is not None:
            return self._forward_packed(x_BTD, packed, rows_S)
        b, t, d = x_BTD.shape
        q_BHTK, k_BHTK, v_BHTK = (z_BTD.view(b, t, self.num_heads, self.head_size).transpose(1, 2)
                                  for z_BTD in self._qkv(x_BTD))
        y_BHTK = attention(q_BHTK, k_BHTK, v_BHTK, keep_B11T, self.attention_dropout if self.training else 0.0,
                           self.fast_dropout)
        y_BTD = y_BHTK.transpose(1, 2).reshape(b, t, d)
        return self.out(take_rows(y_BTD, rows_S))

    def _qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v projections of x (..., D): one matmul over the fused span where a flat layer set it."""
        if self.qkv_span is not None:
            return F.linear(x, *self.qkv_span).chunk(3, dim=-1)
        return self.q(x), self.k(x), self.v(x)

    def _forward_packed(self, x_ND: torch.Tensor, packed: Packed, rows_S: torch.Tensor | None = None) -> torch.Tensor:
        """Projections on the stream, gathered into every group's slots at once (P, 3D) and split into each group's
        (n, H, t, K); each group attended to with SDPA (dropout as in the padded path), laid end to end (P, D), and
        every token's output (or ``rows_S``') taken back from its slot and projected. Both gathers' backwards copy
        (model/gather.py)."""
        h, k = self.num_heads, self.head_size
        dropout_p = self.attention_dropout if self.training else 0.0
        if packed.cu_seqlens_B1 is not None:
            return self.out(take_rows(varlen_attention(*self._qkv(x_ND), packed, h, dropout_p), rows_S))
        groups = packed.groups
        if self.qkv_span is not None:  # fused: one gather of the (N, 3D) projections into every group's slots
            parts = group_heads(gather_slots(F.linear(x_ND, *self.qkv_span), packed), packed, h, k)
        else:  # one gather each of q, k and v
            q_P, k_P, v_P = (packed.split_groups(gather_slots(z_ND, packed)) for z_ND in self._qkv(x_ND))
            parts = [tuple(z.view(g.num_rows, g.length, h, k).transpose(1, 2) for z in qkv)
                     for g, qkv in zip(groups, zip(q_P, k_P, v_P))]
        y_parts = []
        for g, (q_nHtK, k_nHtK, v_nHtK) in zip(groups, parts):
            y_nHtK = attention(q_nHtK, k_nHtK, v_nHtK, g.keep_n11t, dropout_p, self.fast_dropout)
            y_parts.append(y_nHtK.transpose(1, 2).reshape(g.num_rows * g.length, h * k))
        y_PD = y_parts[0] if len(y_parts) == 1 else torch.cat(y_parts)
        return self.out(take_rows(y_PD, packed.slots(rows_S)))


def varlen_attention(q_ND: torch.Tensor, k_ND: torch.Tensor, v_ND: torch.Tensor, packed: Packed, num_heads: int,
                     dropout_p: float) -> torch.Tensor:
    """y_ND: each sequence of the stream attending to itself in one SDPA over nested jagged tensors (``packed``'s
    varlen layout: ``cu_seqlens_B1`` and the host's shortest and longest length). On CUDA that is flash or
    mem-efficient attention over cumulative lengths, reading q/k/v where they lie (strided columns of the fused
    projection included); on the CPU torch's math path, which needs them contiguous and loops over sequences
    with a host read each (tests only: training on a CPU takes the groups). Dropout is SDPA's own."""
    n, d = q_ND.shape
    cpu = q_ND.device.type == "cpu"

    def nested(z_ND: torch.Tensor) -> torch.Tensor:
        z_NHK = z_ND.view(n, num_heads, d // num_heads)
        return torch.nested.nested_tensor_from_jagged(
            z_NHK.contiguous() if cpu else z_NHK, packed.cu_seqlens_B1, min_seqlen=packed.min_length,
            max_seqlen=packed.max_length).transpose(1, 2)

    y = F.scaled_dot_product_attention(nested(q_ND), nested(k_ND), nested(v_ND), dropout_p=dropout_p)
    return y.transpose(1, 2).values().reshape(n, d)
