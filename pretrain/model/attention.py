"""Multi-head self-attention over SDPA: padded (a boolean padding mask) or unpadded (packing.py's groups, or
its varlen layout: aten's flash attention over cumulative lengths on CUDA, nested jagged tensors elsewhere).

Shapes: B batch, T sequence length, D hidden size, H heads, K head size (D = H*K), N packed tokens,
n rows and t length of an attention group, P attention slots of all groups.
Masks: keep_B11T is True where a key position is a real token (may be attended to).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config.model import ModelConfig
from pretrain.model.dropout import attention, group_masks
from pretrain.model.gather import gather_slots, gather_unique, group_heads, heads_to_slots
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

    def _qkv(self, x: torch.Tensor, rows_S: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """q, k, v projections of x (..., D): one matmul over the fused span where a flat layer set it (with q on
        ``rows_S`` of x_ND only, ``project_qkv``)."""
        if self.qkv_span is not None:
            return project_qkv(x, *self.qkv_span, rows_S).chunk(3, dim=-1)
        return self.q(x), self.k(x), self.v(x)

    def _forward_packed(self, x_ND: torch.Tensor, packed: Packed, rows_S: torch.Tensor | None = None) -> torch.Tensor:
        """The stream gathered into every group's slots at once (P, D), projected and split into each group's
        (n, H, t, K); each group attended to with SDPA (dropout as in the padded path), laid end to end (P, D), and
        every token's output (or ``rows_S``') taken back from its slot and projected. Both gathers' backwards copy
        (model/gather.py)."""
        h, k = self.num_heads, self.head_size
        dropout_p = self.attention_dropout if self.training else 0.0
        if packed.cu_seqlens_B1 is not None:
            return self.out(take_rows(varlen_attention(*self._qkv(x_ND, rows_S), packed, h, dropout_p), rows_S))
        groups = packed.groups
        # The stream gathered into the slots before the projections: D columns moved each way, not 3D (the
        # projections also cover the few padding slots, whose q/k/v gradients are zero: model/gather.py).
        x_PD = gather_slots(x_ND, packed)
        slots_S = packed.slots(rows_S)
        if queries_apply(x_PD, packed, slots_S, self.q.weight if self.qkv_span is None else self.qkv_span[0]):
            return self.out(self._attend_rows(x_PD, packed, slots_S, dropout_p))
        if self.qkv_span is not None:  # fused: the (P, 3D) projections split into each group's heads
            parts = group_heads(project_qkv(x_PD, *self.qkv_span, slots_S), packed, h, k, copied=True)
        else:
            parts = group_views(packed, self._qkv(x_PD), h, k)
        y_parts = []
        kept = group_masks(packed.group_shapes, h, dropout_p, self.fast_dropout, x_ND)
        for g, (q_nHtK, k_nHtK, v_nHtK), kept_g in zip(groups, parts, kept):
            y_nHtK = attention(q_nHtK, k_nHtK, v_nHtK, g.keep_n11t, dropout_p, self.fast_dropout, kept=kept_g)
            y_parts.append(y_nHtK)
        return self.out(take_rows(heads_to_slots(y_parts, packed), slots_S))

    def _attend_rows(self, x_PD: torch.Tensor, packed: Packed, slots_S: torch.Tensor, dropout_p: float) -> torch.Tensor:
        """y_SD: the attention outputs of the slots ``slots_S`` only (a trimmed last layer; ``queries_apply``): k and
        v of every slot as in ``_forward_packed``, q of those slots alone (``_QKVOfRows``), laid per group as
        (n, H, m, K) with m the most of them in one of its rows (``QueryLayout``): the scores, probabilities and
        products cover m query rows of a sequence, not t. A row with fewer than m has zero q rows, which attend
        uniformly, are not read and get no gradient. Flat and per-tensor layers alike (the same dropout draws)."""
        h, k = self.num_heads, self.head_size
        if self.qkv_span is not None:
            qkv_P, q_SD = _QKVOfRows.apply(x_PD, *self.qkv_span, slots_S)
            # k and v of each group (q's columns, zero but at slots_S, are copied along and not read)
            kv = [(k_nHtK, v_nHtK) for _, k_nHtK, v_nHtK in group_heads(qkv_P, packed, h, k, copied=True)]
        else:
            q_SD = self.q(gather_unique(x_PD, slots_S))
            kv = group_views(packed, (self.k(x_PD), self.v(x_PD)), h, k)
        layout = QueryLayout.of(packed, slots_S)
        q_QD = q_SD.new_zeros((layout.num_slots, q_SD.shape[1])).index_copy(0, layout.sub_S, q_SD)
        q_parts = (q_QD,) if len(layout.groups) == 1 else q_QD.split(layout.group_sizes)
        y_parts = []
        for (g, n, m), q_mD in zip(layout.groups, q_parts):
            k_nHtK, v_nHtK = kv[g]
            y_parts.append(attention(q_mD.view(n, m, h, k).transpose(1, 2), k_nHtK, v_nHtK,
                                     packed.groups[g].keep_n11t, dropout_p, self.fast_dropout))
        return gather_unique(heads_to_slots(y_parts, layout), layout.sub_S)


@dataclass
class QueryLayout:
    """Where the query slots ``slots_S`` (of ``Packed``'s groups) go when only they attend: every group with any of
    them as (n, m) query slots, m the most of them in one of its n rows; those groups' slots end to end, each
    row-major, a row's queries in slot order first, the rest of its m empty."""

    groups: tuple[tuple[int, int, int], ...]
    """(group index in ``Packed.groups``, n, m) of each group with a query, in order."""
    sub_S: torch.Tensor
    """Each query's position among the query slots."""
    column_S: np.ndarray
    """Each query's column in its group's rows (its position in its sequence), host values."""

    @property
    def group_shapes(self) -> tuple[tuple[int, int], ...]:
        return tuple((n, m) for _, n, m in self.groups)

    @property
    def group_sizes(self) -> list[int]:
        return [n * m for n, m in self.group_shapes]

    @property
    def num_slots(self) -> int:
        return sum(self.group_sizes)

    @staticmethod
    def of(packed: Packed, slots_S: torch.Tensor) -> QueryLayout:
        """From a host tensor of slots (numpy on the host: no device op)."""
        n_G = np.array([n for n, _ in packed.group_shapes], dtype=np.int64)
        t_G = np.array([t for _, t in packed.group_shapes], dtype=np.int64)
        start_G, row_start_G = np.cumsum(n_G * t_G) - n_G * t_G, np.cumsum(n_G) - n_G
        slots = slots_S.numpy()
        group_S = np.searchsorted(start_G, slots, side="right") - 1
        row_S = (slots - start_G[group_S]) // t_G[group_S]  # within its group
        global_S = row_start_G[group_S] + row_S
        count_R = np.bincount(global_S, minlength=int(n_G.sum()))
        order = np.argsort(slots, kind="stable")  # a row's slots are a run: sorted, its queries are consecutive
        rank_S = np.empty_like(slots)
        rank_S[order] = np.arange(len(slots)) - (np.cumsum(count_R) - count_R)[global_S[order]]
        m_G = np.maximum.reduceat(count_R, row_start_G)
        size_G = n_G * m_G
        sub_S = (np.cumsum(size_G) - size_G)[group_S] + row_S * m_G[group_S] + rank_S
        groups = tuple((g, int(n_G[g]), int(m_G[g])) for g in range(len(n_G)) if m_G[g] > 0)
        column_S = (slots - start_G[group_S]) % t_G[group_S]
        return QueryLayout(groups, torch.from_numpy(sub_S.astype(np.int64)), column_S)

    def columns(self) -> list[torch.Tensor]:
        """Per group with queries, (n, m): the column each query slot reads its q from (an empty slot: column 0,
        whose output is not read and whose gradient is therefore zero)."""
        column_Q = np.zeros(self.num_slots, dtype=np.int64)
        column_Q[self.sub_S.numpy()] = self.column_S
        parts = np.split(column_Q, np.cumsum(self.group_sizes)[:-1])
        return [torch.from_numpy(c.reshape(n, m)) for c, (n, m) in zip(parts, self.group_shapes)]


def group_views(packed: Packed, zs_P, heads: int, size: int) -> list[tuple[torch.Tensor, ...]]:
    """Each group's (n, heads, t, size) views of the (P, heads * size) tensors ``zs_P`` (one per projection)."""
    return [tuple(z.view(g.num_rows, g.length, heads, size).transpose(1, 2) for z in parts)
            for g, parts in zip(packed.groups, zip(*(packed.split_groups(z) for z in zs_P)))]


def rows_apply(x_RD: torch.Tensor, rows_S: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether the projections (``project_qkv``) and attention (``queries_apply``) of a trimmed layer take its kept
    rows only: eager on the CPU (rows on the host), no autocast, 2-D x of the weight's dtype, some rows kept but at
    most half of them."""
    return (rows_S is not None and x_RD.device.type == "cpu" and rows_S.device.type == "cpu"
            and not torch.compiler.is_compiling() and not torch.is_autocast_enabled("cpu") and x_RD.dim() == 2
            and x_RD.dtype == weight.dtype and 0 < 2 * rows_S.shape[0] <= x_RD.shape[0])


def queries_apply(x_PD: torch.Tensor, packed: Packed, slots_S: torch.Tensor | None, weight: torch.Tensor) -> bool:
    """Whether a trimmed layer attends for its kept slots only (``SelfAttention._attend_rows``): ``rows_apply``,
    over the groups' slots."""
    return rows_apply(x_PD, slots_S, weight) and packed.back_N is not None and bool(packed.groups)


def project_qkv(x_RD: torch.Tensor, weight_CD: torch.Tensor, bias_C: torch.Tensor | None,
                rows_S: torch.Tensor | None) -> torch.Tensor:
    """qkv_RC = x_RD W^T + b, the fused q/k/v projections (C = 3D, q's D columns first); with ``rows_S`` (the rows
    whose attention output is read: a trimmed last layer's tokens) q only on those rows and zero elsewhere
    (``_QKVOfRows``): k and v are needed at every key, q only where an output is kept. A zero q row attends
    uniformly; its output is not read, so its gradient is zero, and so are its contributions to k's and v's: the
    kept rows' outputs and all gradients are those of the full projection. Where ``rows_apply`` (torch's projection
    elsewhere: on CUDA it waits for a device pass)."""
    if not rows_apply(x_RD, rows_S, weight_CD):
        return F.linear(x_RD, weight_CD, bias_C)
    return _QKVOfRows.apply(x_RD, weight_CD, bias_C, rows_S)[0]


class _QKVOfRows(torch.autograd.Function):
    """``project_qkv`` with its rows: k, v written by one matmul into the output's last 2D columns (a strided
    output, which BLAS writes in place), q's rows by one over the S kept rows, returned also as they are (q_SD,
    for ``SelfAttention._attend_rows``); backward the same split, the weight's gradient written in its two row
    blocks. Saves a third of the layer's projection FLOPs, less S/R of that."""

    @staticmethod
    def forward(ctx, x_RD, weight_CD, bias_C, rows_S):
        d = weight_CD.shape[0] // 3
        qkv_RC = x_RD.new_empty((x_RD.shape[0], weight_CD.shape[0]))
        kv_w, q_w = weight_CD[d:].t(), weight_CD[:d].t()
        if bias_C is None:
            torch.mm(x_RD, kv_w, out=qkv_RC[:, d:])
        else:
            torch.addmm(bias_C[d:], x_RD, kv_w, out=qkv_RC[:, d:])
        x_SD = x_RD.index_select(0, rows_S)
        q_SD = torch.mm(x_SD, q_w) if bias_C is None else torch.addmm(bias_C[:d], x_SD, q_w)
        q_RD = qkv_RC[:, :d]
        q_RD.zero_()
        q_RD.index_copy_(0, rows_S, q_SD)
        ctx.save_for_backward(x_RD, weight_CD, rows_S, x_SD)
        return qkv_RC, q_SD

    @staticmethod
    def backward(ctx, grad_RC, grad_q_SD):
        x_RD, weight_CD, rows_S, x_SD = ctx.saved_tensors
        d = weight_CD.shape[0] // 3
        grad_kv = grad_RC[:, d:]
        grad_q_SD = grad_RC[:, :d].index_select(0, rows_S) + grad_q_SD  # q read in place or as its rows
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = torch.mm(grad_kv, weight_CD[d:])
            grad_x.index_add_(0, rows_S, torch.mm(grad_q_SD, weight_CD[:d]))
        if ctx.needs_input_grad[1]:
            grad_w = weight_CD.new_empty(weight_CD.shape)
            torch.mm(grad_kv.t(), x_RD, out=grad_w[d:])
            torch.mm(grad_q_SD.t(), x_SD, out=grad_w[:d])
        if ctx.needs_input_grad[2]:  # False without a bias
            grad_b = torch.cat([grad_q_SD.sum(0), grad_kv.sum(0)])
        return grad_x, grad_w, grad_b, None


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
    """Whether ``flash_varlen`` runs for ``x`` (q's stream): ``flash_varlen_refusal`` has no reason against it."""
    return flash_varlen_refusal(x.device, x.dtype, head_size) is None


def flash_varlen_refusal(device: torch.device, dtype: torch.dtype, head_size: int,
                         dtype_name: str | None = None) -> str | None:
    """Why ``flash_varlen`` does not run on ``device`` for ``dtype`` inputs of ``head_size`` (the varlen layout then
    takes the nested tensors), or None: it needs CUDA with flash attention enabled, bf16 or fp16, a head size flash
    takes (a multiple of 8 up to 256), compute capability 8.0 or newer. ``dtype_name``: how the reason names the
    dtype (a config's setting)."""
    if device.type != "cuda":
        return "no GPU"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"{dtype_name or dtype}: the direct flash call takes bf16 or fp16"
    if head_size % 8 or head_size > 256:
        return f"a head size of {head_size}: flash takes multiples of 8 up to 256"
    if not torch.backends.cuda.flash_sdp_enabled():
        return "flash attention disabled (torch.backends.cuda.enable_flash_sdp)"
    if torch.cuda.get_device_capability(device)[0] < 8:
        return "a GPU older than compute capability 8.0"
    return None


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
