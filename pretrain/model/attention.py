"""Multi-head self-attention over SDPA: padded (a boolean padding mask) or unpadded (packing.py's groups, or
its varlen layout: aten's flash attention over cumulative lengths on CUDA, nested jagged tensors elsewhere).

Shapes: B batch, T sequence length, D hidden size, H heads, K head size (D = H*K), N packed tokens,
n rows and t length of an attention group, P attention slots of all groups.
Masks: keep_B11T is True where a key position is a real token (may be attended to).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config.model import ModelConfig
from pretrain.model.dropout import attention, group_masks
from pretrain.model.gather import gather_slots, group_heads, heads_to_slots
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
        """The stream gathered into every group's slots at once (P, D), projected and split into each group's
        (n, H, t, K); each group attended to with SDPA (dropout as in the padded path), laid end to end (P, D), and
        every token's output (or ``rows_S``') taken back from its slot and projected. Both gathers' backwards copy
        (model/gather.py)."""
        h, k = self.num_heads, self.head_size
        dropout_p = self.attention_dropout if self.training else 0.0
        if packed.cu_seqlens_B1 is not None:
            return self.out(take_rows(varlen_attention(*self._qkv(x_ND), packed, h, dropout_p), rows_S))
        groups = packed.groups
        # The stream gathered into the slots before the projections: D columns moved each way, not 3D (the
        # projections also cover the few padding slots, whose q/k/v gradients are zero: model/gather.py).
        x_PD = gather_slots(x_ND, packed)
        if self.qkv_span is not None:  # fused: the (P, 3D) projections split into each group's heads
            parts = group_heads(F.linear(x_PD, *self.qkv_span), packed, h, k, copied=True)
        else:
            q_P, k_P, v_P = (packed.split_groups(z_PD) for z_PD in self._qkv(x_PD))
            parts = [tuple(z.view(g.num_rows, g.length, h, k).transpose(1, 2) for z in qkv)
                     for g, qkv in zip(groups, zip(q_P, k_P, v_P))]
        y_parts = []
        kept = group_masks(packed.group_shapes, h, dropout_p, self.fast_dropout, x_ND)
        for g, (q_nHtK, k_nHtK, v_nHtK), kept_g in zip(groups, parts, kept):
            y_nHtK = attention(q_nHtK, k_nHtK, v_nHtK, g.keep_n11t, dropout_p, self.fast_dropout, kept=kept_g)
            y_parts.append(y_nHtK)
        return self.out(take_rows(heads_to_slots(y_parts, packed), packed.slots(rows_S)))


def varlen_attention(q_ND: torch.Tensor, k_ND: torch.Tensor, v_ND: torch.Tensor, packed: Packed, num_heads: int,
                     dropout_p: float) -> torch.Tensor:
    """y_ND: each sequence of the stream attending to itself in one call (``packed``'s varlen layout:
    ``cu_seqlens_B1`` and the host's shortest and longest length). On CUDA in bf16/fp16 aten's flash attention over
    the cumulative lengths, called directly (``flash_varlen``); elsewhere SDPA over nested jagged tensors: on CUDA
    in fp32 mem-efficient attention over the same lengths, on the CPU torch's math path, which needs q/k/v
    contiguous and loops over sequences with a host read each (tests only: training on a CPU takes the groups).
    Both read q/k/v where they lie on CUDA (strided columns of the fused projection included). Dropout is the
    kernel's own."""
    n, d = q_ND.shape
    k = d // num_heads
    if not flash_varlen_applies(q_ND, k):
        return nested_attention(q_ND, k_ND, v_ND, packed, num_heads, dropout_p)
    q_NHK, k_NHK, v_NHK = (z_ND.view(n, num_heads, k) for z_ND in (q_ND, k_ND, v_ND))
    return flash_varlen(q_NHK, k_NHK, v_NHK, packed.cu_seqlens_B1, packed.max_length, dropout_p).reshape(n, d)


def nested_attention(q_ND: torch.Tensor, k_ND: torch.Tensor, v_ND: torch.Tensor, packed: Packed, num_heads: int,
                     dropout_p: float) -> torch.Tensor:
    """``varlen_attention`` through SDPA over nested jagged tensors (where ``flash_varlen`` does not run)."""
    n, d = q_ND.shape
    cpu = q_ND.device.type == "cpu"

    def nested(z_ND: torch.Tensor) -> torch.Tensor:
        z_NHK = z_ND.view(n, num_heads, d // num_heads)
        return torch.nested.nested_tensor_from_jagged(
            z_NHK.contiguous() if cpu else z_NHK, packed.cu_seqlens_B1, min_seqlen=packed.min_length,
            max_seqlen=packed.max_length).transpose(1, 2)

    y = F.scaled_dot_product_attention(nested(q_ND), nested(k_ND), nested(v_ND), dropout_p=dropout_p)
    return y.transpose(1, 2).values().reshape(n, d)


def flash_varlen_applies(x: torch.Tensor, head_size: int) -> bool:
    """Whether ``flash_varlen`` runs for ``x`` (q's stream): CUDA with flash attention enabled, bf16 or fp16, a head
    size flash takes (a multiple of 8 up to 256), compute capability 8.0 or newer."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and head_size % 8 == 0 and head_size <= 256
            and torch.backends.cuda.flash_sdp_enabled() and torch.cuda.get_device_capability(x.device)[0] >= 8)


def flash_varlen(q_NHK: torch.Tensor, k_NHK: torch.Tensor, v_NHK: torch.Tensor, cu_B1: torch.Tensor, max_len: int,
                 dropout_p: float) -> torch.Tensor:
    """y_NHK: aten's flash attention over cumulative lengths, called directly: the kernel (and its autograd
    formula, ``FlashAttentionBackward0``) that SDPA over nested jagged tensors reaches on CUDA in bf16, without the
    nested tensors' Python dispatch (on the H200, 2026-11-28, that dispatch took 51% of the eager step's host time
    and left the GPU idle 57% of the step). q/k/v (N, H, K) with unit stride in K (rows and heads may be strided),
    ``cu_B1`` (B + 1,) int32 offsets, ``max_len`` the longest sequence (given, so the device is not asked); the
    scale SDPA's default, 1/sqrt(K). Dropout's seed and offset go from the forward to the backward inside aten."""
    return torch.ops.aten._flash_attention_forward(q_NHK, k_NHK, v_NHK, cu_B1, cu_B1, max_len, max_len, dropout_p,
                                                   False, False, scale=q_NHK.shape[-1] ** -0.5)[0]
