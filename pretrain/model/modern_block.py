"""ModernBERT's layer (model.arch=modernbert): embeddings, rotary attention, GeGLU and the pre-norm block; the
encoder that stacks them is modern.py.

Shapes: B batch, T sequence length, D hidden size, H heads, K head size (D = H*K), F feed-forward (gated) size,
N packed tokens (unpadded, see packing.py), n rows and t length of an attention group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config.model import ModelConfig
from pretrain.model.attention import QueryLayout, project_qkv, queries_apply
from pretrain.model.banded import Band, banded_attention
from pretrain.model.block import GELU_FORMS, activation_fn
from pretrain.model.dropout import Dropout, attention, attention_dtype, group_masks
from pretrain.model.embeddings import Embedding
from pretrain.model.flat import forget_traced_views, materialize
from pretrain.model.gather import gather_slots, gather_unique, group_heads, heads_to_slots
from pretrain.model.kernels import KINDS, cpu_kernels
from pretrain.model.packing import Packed, take_rows
from pretrain.model.rotary import apply_rope, apply_rope_qk


@dataclass
class AttentionInputs:
    """What every layer of one kind (global or local) shares in one forward: rotary tables and masks."""

    cos: torch.Tensor
    sin: torch.Tensor
    mask: torch.Tensor | Band | None = None
    """Padded path: (B, 1, T, T) / (T, T) / (B, 1, 1, T), a local layer's ``Band`` (banded.py), or None."""
    group_masks: tuple[torch.Tensor | Band | None, ...] = ()
    """Unpadded path: one mask (or ``Band``) per attention group of ``packed``."""
    qk_cos: torch.Tensor | None = None
    qk_sin: torch.Tensor | None = None
    """(2, 1, 1, T, K): the queries' tables times 1/sqrt(K), then the keys' (the CPU, eager; ``scaled_tables``):
    RoPE writes q as attention's scores read it, so attention skips its own pass over q (and over its gradient),
    and rotates a group's q and k in one call (``rotary.apply_rope_qk``)."""


def scaled_tables(cos: torch.Tensor, sin: torch.Tensor, head_size: int) -> dict[str, torch.Tensor]:
    """``AttentionInputs``' qk_cos/qk_sin where they pay (the CPU, eager: a multiply per group and layer saved; CUDA
    scales inside its attention kernel for nothing), else none. For K = 64 (every ModernBERT size but tiny) the
    factor is 1/8, exact."""
    if cos.device.type != "cpu" or torch.compiler.is_compiling():
        return {}
    scale = head_size ** -0.5
    return {"qk_cos": torch.stack((cos * scale, cos))[:, None, None],
            "qk_sin": torch.stack((sin * scale, sin))[:, None, None]}


def _rope(q: torch.Tensor, k: torch.Tensor, inputs: AttentionInputs, length: int,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(q, k, q_scaled): q and k (..., length, K) rotated by the first ``length`` positions' angles, in ``dtype``;
    q_scaled where q carries attention's 1/sqrt(K) (``AttentionInputs.qk_cos``)."""
    if inputs.qk_cos is None:
        cos, sin = inputs.cos[:length], inputs.sin[:length]
        return apply_rope(q, cos, sin, dtype), apply_rope(k, cos, sin, dtype), False
    q, k = apply_rope_qk(q, k, inputs.qk_cos[..., :length, :], inputs.qk_sin[..., :length, :], dtype)
    return q, k, True


def is_global_layer(cfg: ModelConfig, layer_id: int) -> bool:
    return layer_id % cfg.global_every == 0


class ModernEmbeddings(nn.Module):
    """ids -> drop(norm(word[ids])); token types and positions are not embedded (rotary acts in attention)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.word = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=False)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.norm(self.word(input_ids)))


class ModernAttention(nn.Module):
    """Fused bias-free q/k/v projection (transformers' Wqkv layout: q, k, v stacked), RoPE, SDPA, output."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads, self.head_size = cfg.num_heads, d // cfg.num_heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.out = nn.Linear(d, d, bias=False)
        self.attention_dropout = cfg.attention_dropout
        self.fast_dropout = True
        """Attention dropout on the CPU with model/dropout.py's masks (train.fast_dropout)."""

    def forward(self, x_BTD: torch.Tensor, inputs: AttentionInputs, packed: Packed | None,
                rows_S: torch.Tensor | None = None) -> torch.Tensor:
        """x_BTD -> y_BTD (x_ND -> y_ND with ``packed``; y_SD of the tokens ``rows_S``, ``packing.take_rows``),
        before the residual."""
        h, k = self.num_heads, self.head_size
        dropout_p = self.attention_dropout if self.training else 0.0
        qk_dtype = attention_dtype(x_BTD, dropout_p, self.fast_dropout)  # RoPE's output: fp32 where attention upcasts
        if packed is not None:
            if packed.cu_seqlens_B1 is not None:
                raise ValueError("model.arch=modernbert attends per attention group: a local layer's window is a mask, "
                                 "which the varlen layout does not take; set train.unpadded_attention=groups (or auto)")
            # One gather of the stream into every group's slots, then the projections (D columns moved each way, not
            # 3D; the projection also covers the few padding slots, whose q/k/v gradients are zero: gather.py);
            # RoPE by slot column (tables (T, K)), which writes q and k head-major (n, H, t, K) for attention
            # (rotary._rotate: contiguous output).
            y_parts = []
            slots_S = packed.slots(rows_S)
            x_PD = gather_slots(x_BTD, packed)
            qkv = group_heads(project_qkv(x_PD, self.qkv.weight, None, slots_S), packed, h, k)
            if self._kept_queries(x_PD, packed, slots_S, inputs):
                return self.out(self._attend_rows(qkv, inputs, packed, slots_S, dropout_p, qk_dtype))
            # The probabilities' dropout masks drawn for the layer at once, except for a local layer's banded groups,
            # whose attention draws its own (its probabilities are blocks of the band, banded.py).
            shapes = packed.group_shapes
            banded = any(isinstance(m, Band) for m in inputs.group_masks)
            kept = [None] * len(shapes) if banded else group_masks(shapes, h, dropout_p, self.fast_dropout, x_BTD)
            for g, mask, (q_nHtK, k_nHtK, v_nHtK), kept_g in zip(packed.groups, inputs.group_masks, qkv, kept):
                q_nHtK, k_nHtK, q_scaled = _rope(q_nHtK, k_nHtK, inputs, g.length, qk_dtype)
                y_nHtK = _attend(q_nHtK, k_nHtK, v_nHtK, mask, dropout_p, self.fast_dropout, q_scaled, kept_g)
                y_parts.append(y_nHtK)
            return self.out(take_rows(heads_to_slots(y_parts, packed), slots_S))
        b, t, d = x_BTD.shape
        q_BHTK, k_BHTK, v_BHTK = self.qkv(x_BTD).view(b, t, 3, h, k).permute(2, 0, 3, 1, 4).unbind(0)
        q_BHTK, k_BHTK, q_scaled = _rope(q_BHTK, k_BHTK, inputs, t, qk_dtype)
        y_BHTK = _attend(q_BHTK, k_BHTK, v_BHTK, inputs.mask, dropout_p, self.fast_dropout, q_scaled)
        return self.out(take_rows(y_BHTK.transpose(1, 2).reshape(b, t, d), rows_S))

    def _kept_queries(self, x_PD: torch.Tensor, packed: Packed, slots_S: torch.Tensor | None,
                      inputs: AttentionInputs) -> bool:
        """Whether this (trimmed last) layer attends for its kept slots only: ``queries_apply``, in a global layer
        (a local one's window would have to follow each kept query: it attends in full)."""
        return (queries_apply(x_PD, packed, slots_S, self.qkv.weight)
                and all(m is None or (torch.is_tensor(m) and m.shape[-2] == 1) for m in inputs.group_masks))

    def _attend_rows(self, qkv: list, inputs: AttentionInputs, packed: Packed, slots_S: torch.Tensor,
                     dropout_p: float, qk_dtype: torch.dtype) -> torch.Tensor:
        """y_SD: the attention outputs of the slots ``slots_S`` only, as BERT's ``SelfAttention._attend_rows``: each
        group with a kept query rotated as in the full layer, then its kept queries taken from their columns into
        (n, H, m, K) (``QueryLayout``) against the group's t keys and values; groups without one are skipped."""
        layout = QueryLayout.of(packed, slots_S)
        y_parts = []
        for (g, n, m), column_nm in zip(layout.groups, layout.columns()):
            q_nHtK, k_nHtK, v_nHtK = qkv[g]
            q_nHtK, k_nHtK, q_scaled = _rope(q_nHtK, k_nHtK, inputs, packed.groups[g].length, qk_dtype)
            index = column_nm.view(n, 1, m, 1).expand(n, q_nHtK.shape[1], m, q_nHtK.shape[3])
            q_nHmK = torch.gather(q_nHtK, 2, index)
            y_parts.append(_attend(q_nHmK, k_nHtK, v_nHtK, inputs.group_masks[g], dropout_p, self.fast_dropout,
                                   q_scaled))
        return gather_unique(heads_to_slots(y_parts, layout), layout.sub_S)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | Band | None,
            dropout_p: float, fast: bool = True, q_scaled: bool = False,
            kept: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    if isinstance(mask, Band):
        return banded_attention(q, k, v, mask, dropout_p, fast, q_scaled)
    return attention(q, k, v, mask, dropout_p, fast, q_scaled, kept)


class GeGLU(nn.Module):
    """x -> Wo(act(u) * g) with [u, g] = Wi(x) (Wi: D -> 2F, u first, as transformers' ModernBertMLP)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.wi = nn.Linear(cfg.hidden_size, 2 * cfg.ffn_size, bias=False)
        self.wo = nn.Linear(cfg.ffn_size, cfg.hidden_size, bias=False)
        self.act = activation_fn(cfg.activation)
        self.approximate = GELU_FORMS.get(cfg.activation)
        """GELU's form where the activation is one (``_GatedGelu``), else None."""

    def forward(self, x_BTD: torch.Tensor) -> torch.Tensor:
        z_BT2F = self.wi(x_BTD)
        if self.approximate is not None and not torch.compiler.is_compiling():
            return self.wo(_GatedGelu.apply(z_BT2F, self.approximate))
        u_BTF, g_BTF = z_BT2F.chunk(2, dim=-1)
        return self.wo(self.act(u_BTF) * g_BTF)


class _GatedGelu(torch.autograd.Function):
    """gelu(u) * g of z = [u, g] with the backward written into one (..., 2F) gradient: du = gelu'(u) (g dh) and
    dg = gelu(u) dh straight into its two halves, where autograd's chunk backward concatenated them in one more
    pass (ModernBERT mini's (7027, 768) fp32 GeGLU, forward + backward: 9.0 -> 7.1 ms; docs/performance.md).
    On the CPU, for erf's GELU in fp32/bf16, the C kernel (``kernels.cpu_kernels().geglu``) does each pass in one
    sweep and saves only z (gelu(u) is computed again in the backward: no (..., F) activation kept); elsewhere
    torch's ops, saving z and gelu(u), as autograd did. Eager only; compiled, inductor fuses the formula."""

    @staticmethod
    def forward(ctx, z: torch.Tensor, approximate: str) -> torch.Tensor:
        ctx.approximate = approximate
        ctx.in_c = _geglu_in_c(z, approximate)
        if ctx.in_c:
            z = z.contiguous()
            h = z.new_empty((*z.shape[:-1], z.shape[-1] // 2))
            cpu_kernels().geglu(z.data_ptr(), 0, h.data_ptr(), z.numel() // z.shape[-1], z.shape[-1] // 2,
                                KINDS[z.dtype], torch.get_num_threads())
            ctx.save_for_backward(z)
            return h
        u, g = z.chunk(2, dim=-1)
        a = F.gelu(u, approximate=approximate)
        ctx.save_for_backward(z, a)
        return a * g

    @staticmethod
    def backward(ctx, grad_h: torch.Tensor):
        if ctx.in_c:
            (z,) = ctx.saved_tensors
            grad_h = grad_h.to(z.dtype).contiguous()
            grad_z = torch.empty_like(z)
            cpu_kernels().geglu(z.data_ptr(), grad_h.data_ptr(), grad_z.data_ptr(), z.numel() // z.shape[-1],
                                z.shape[-1] // 2, KINDS[z.dtype], torch.get_num_threads())
            return grad_z, None
        z, a = ctx.saved_tensors
        u, g = z.chunk(2, dim=-1)
        grad_z = torch.empty_like(z, memory_format=torch.contiguous_format)
        grad_u, grad_g = grad_z.chunk(2, dim=-1)
        torch.mul(grad_h, a, out=grad_g)
        torch.ops.aten.gelu_backward.grad_input(grad_h * g, u, approximate=ctx.approximate, grad_input=grad_u)
        return grad_z, None


def _geglu_in_c(z: torch.Tensor, approximate: str) -> bool:
    """Whether ``_GatedGelu`` runs the C kernel: built, the CPU, erf's GELU, fp32/bf16, an even last dim, not empty."""
    return (cpu_kernels() is not None and z.device.type == "cpu" and approximate == "none" and z.dtype in KINDS
            and z.numel() > 0 and z.shape[-1] % 2 == 0)


class ModernBlock(nn.Module):
    """Pre-norm layer; layer 0 has no attention norm (the embedding norm precedes it), as in ModernBERT."""

    def __init__(self, cfg: ModelConfig, layer_id: int) -> None:
        super().__init__()
        self.is_global = is_global_layer(cfg, layer_id)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=False) if layer_id else None
        self.attn = ModernAttention(cfg)
        self.ffn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps, bias=False)
        self.ffn = GeGLU(cfg)
        self.dropout = Dropout(cfg.dropout)

    def forward(self, x_BTD: torch.Tensor, inputs: AttentionInputs, packed: Packed | None = None,
                rows_S: torch.Tensor | None = None) -> torch.Tensor:
        """As ``Block.forward``: with ``rows_S`` only those tokens' outputs, x_SD."""
        materialize(self)  # a flattened layer's parameter views (model/flat.py)
        a_BTD = x_BTD if self.attn_norm is None else self.attn_norm(x_BTD)
        y_BTD = self.attn(a_BTD, inputs, packed, rows_S)
        x_BTD = take_rows(x_BTD, rows_S) + self.dropout(y_BTD)
        x_BTD = x_BTD + self.dropout(self.ffn(self.ffn_norm(x_BTD)))
        forget_traced_views(self)
        return x_BTD
