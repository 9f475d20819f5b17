"""Rotary position embeddings (RoPE, Su et al. 2021) and the sliding-window attention mask, as ModernBERT uses them.

Shapes: B batch, T sequence length, N packed tokens, H heads, K head size.

RoPE rotates each (x_i, x_{i+K/2}) pair of a query/key head by angle pos * theta^(-2i/K):
    rope(x) = x * cos + rotate_half(x) * sin,   rotate_half([a, b]) = [-b, a]
(the half-split layout of transformers' ModernBERT, so exported weights need no permutation). The tables hold no
state: they are computed from the positions every forward (K/2 frequencies), so a model built on the meta device
and allocated later has nothing left uninitialised, and any length works.
"""

from __future__ import annotations

import torch

from pretrain.model.kernels import KINDS, cpu_kernels


def rope_tables(position_ids: torch.Tensor, head_size: int, theta: float,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) of shape position_ids.shape + (K,), in fp32 arithmetic (as transformers), rounded to ``dtype`` (as
    transformers' tables are) and held in fp32: RoPE's arithmetic is fp32 either way, so the tables are not cast
    again in every layer and attention group (ModernBERT mini bf16 on the CPU: 256 casts a step)."""
    inv_freq_K2 = 1.0 / (theta ** (torch.arange(0, head_size, 2, dtype=torch.float,
                                                  device=position_ids.device) / head_size))
    freqs = position_ids[..., None].float() * inv_freq_K2
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype).float(), emb.sin().to(dtype).float()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float,
            dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """x * cos + sign * rotate_half(x) * sin in fp32, rounded to ``dtype``, written into one new contiguous tensor
    (``sign`` -1: the inverse rotation, RoPE's backward). The tables' two halves are equal (``rope_tables``), so
    either half serves. On the CPU the C kernel (``kernels.cpu_kernels().rope``) reads x once and writes the result
    once; elsewhere, or without it, the product with cos, then each half's rotated term added in place, then the
    cast (the same fp32 arithmetic: the cos product rounded, the sin product fused into the sum, as ``addcmul_``'s
    vectorised CPU kernel does).

    Contiguous whatever x's strides: q and k arrive as head-major views of the fused projection ((n, H, t, K) over
    (n, t, H, K) memory), and a product would keep that memory order, so attention's ``q @ k.T`` copied both into
    head-major order again to fold (n, H) into one batch dimension (ModernBERT mini on the CPU: 7-13 ms of copies a
    step, docs/performance.md). Written head-major here, they go to the matmul as they are."""
    y = _rotate_in_c(x, cos, sin, sign, dtype)
    if y is not None:
        return y
    half = x.shape[-1] // 2
    if x.dtype != torch.float32 and x.device.type == "cpu":  # the CPU casts a mixed-dtype op's operand into a new
        x = x.to(torch.float32, memory_format=torch.contiguous_format)  # tensor: once here, not in each op below
    y = torch.mul(x, cos, out=torch.empty(x.shape, dtype=torch.float32, device=x.device))
    x1, x2, s = x[..., :half], x[..., half:], sin[..., :half]
    y[..., :half].addcmul_(x2, s, value=-sign)
    y[..., half:].addcmul_(x1, s, value=sign)
    return y.to(dtype)


def _rotate_in_c(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, sign: float,
                 dtype: torch.dtype) -> torch.Tensor | None:
    """``_rotate`` by the C kernel, or None where it cannot run (not built, not the CPU, another dtype, more than 5
    dimensions, a strided last dimension, tables that are not fp32 or not broadcastable to x, an empty x)."""
    kernel = cpu_kernels()
    if (kernel is None or x.device.type != "cpu" or x.dtype not in KINDS or dtype not in KINDS or x.dim() > 5
            or x.stride(-1) != 1 or cos.dtype != torch.float32 or sin.dtype != torch.float32
            or cos.device.type != "cpu" or sin.device.type != "cpu" or x.shape[-1] % 2 or x.numel() == 0):
        return None
    try:
        cos, sin = cos.broadcast_to(x.shape), sin.broadcast_to(x.shape)
    except RuntimeError:
        return None
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        return None
    y = torch.empty(x.shape, dtype=dtype)
    pad = (1,) * (5 - x.dim()), (0,) * (5 - x.dim())
    kernel.rope(x.data_ptr(), KINDS[x.dtype], pad[0] + tuple(x.shape), pad[1] + x.stride()[:-1], cos.data_ptr(),
                sin.data_ptr(), pad[1] + cos.stride()[:-1], y.data_ptr(), KINDS[dtype], sign, torch.get_num_threads())
    return y


class _Rope(torch.autograd.Function):
    """RoPE with the backward written out (the inverse rotation of the gradient): two fused passes each way instead
    of autograd's chain through ``_rotate_half``'s negation, slices and concatenation (whose backward fills
    zeros for every slice), and nothing saved but the tables."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        ctx.x_dtype = x.dtype
        return _rotate(x, cos, sin, 1.0, dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # grad has the output's dtype
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, -1.0, ctx.x_dtype), None, None, None


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               dtype: torch.dtype | None = None) -> torch.Tensor:
    """x rotated by its positions' angles; cos/sin broadcast against x (e.g. x_BHTK with cos_TK, x_NHK with
    cos_N1K). Computed in fp32 and cast to ``dtype``, by default x's, as transformers does; fp32 where the attention
    computes bf16/fp16 inputs in fp32 anyway (``dropout.attention_dtype``), so that q and k are not rounded to bf16
    only to be cast back (and their gradients likewise). The tables carry no gradient (they are functions of the
    positions); eagerly, ``_Rope``'s written-out backward; compiled, the formula itself (inductor fuses it)."""
    cos, sin, dtype = cos.float(), sin.float(), dtype or x.dtype
    if torch.compiler.is_compiling() or cos.requires_grad or sin.requires_grad:
        xf = x.float()
        return (xf * cos + _rotate_half(xf) * sin).to(dtype)
    return _Rope.apply(x, cos, sin, dtype)


class _RopeQK(torch.autograd.Function):
    """``_Rope`` of a group's queries and keys in one autograd node, and where they are the same slices of one fused
    projection (``_joint``: a fixed distance apart with equal strides) in one rotation over both: 3 ops and one
    node a group and layer instead of 6 and two (ModernBERT mini: 64 group-layers a step on the CPU)."""

    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, cos_2: torch.Tensor, sin_2: torch.Tensor,
                dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        ctx.save_for_backward(cos_2, sin_2)
        ctx.dtypes = (q.dtype, k.dtype)
        qk = _joint(q, k)
        if qk is None:
            return _rotate(q, cos_2[0], sin_2[0], 1.0, dtype), _rotate(k, cos_2[1], sin_2[1], 1.0, dtype)
        y = _rotate(qk, cos_2, sin_2, 1.0, dtype)
        return y[0], y[1]

    @staticmethod
    def backward(ctx, grad_q: torch.Tensor, grad_k: torch.Tensor):
        cos_2, sin_2 = ctx.saved_tensors
        return (_rotate(grad_q, cos_2[0], sin_2[0], -1.0, ctx.dtypes[0]),
                _rotate(grad_k, cos_2[1], sin_2[1], -1.0, ctx.dtypes[1]), None, None, None)


def _joint(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor | None:
    """(2, *q.shape): q and k as one strided view (read only), where k lies a fixed distance after q in the same
    storage with the same shape and strides (a fused projection's q and k heads), else None."""
    if (q.shape != k.shape or q.stride() != k.stride() or q.dtype != k.dtype or q.device != k.device
            or q.untyped_storage().data_ptr() != k.untyped_storage().data_ptr()):
        return None
    step = k.storage_offset() - q.storage_offset()
    return q.as_strided((2, *q.shape), (step, *q.stride()), q.storage_offset()) if step > 0 else None


def apply_rope_qk(q: torch.Tensor, k: torch.Tensor, cos_2: torch.Tensor, sin_2: torch.Tensor,
                  dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(``apply_rope(q, cos_2[0], sin_2[0], dtype)``, ``apply_rope(k, cos_2[1], sin_2[1], dtype)``): the queries'
    and keys' tables stacked ((2, ..., K), e.g. the queries' carrying attention's scale), in one autograd node
    (``_RopeQK``) eagerly; compiled, the two formulas."""
    cos_2, sin_2 = cos_2.float(), sin_2.float()
    if torch.compiler.is_compiling() or cos_2.requires_grad or sin_2.requires_grad:
        return apply_rope(q, cos_2[0], sin_2[0], dtype), apply_rope(k, cos_2[1], sin_2[1], dtype)
    return _RopeQK.apply(q, k, cos_2, sin_2, dtype or q.dtype)


def window_mask(keep_B11T: torch.Tensor | None, length: int, half_window: int,
                device: torch.device) -> torch.Tensor | None:
    """Boolean attention mask (True = may attend) of a local layer: key within ``half_window`` positions of the
    query, and a real token. Shape (T, T) without padding, else (B, 1, T, T). None when the window covers every
    pair (T - 1 <= half_window): the global mask then serves; not in a compiled step, where that choice would be a
    guard on T (the unpadded step's attention groups cross it from batch to batch: a recompile each time).

    A padding query may attend to every real key, so that no row is fully masked (SDPA gives NaN for one, and a
    NaN, even in a row nobody reads, reaches the gradients); its output is never used."""
    if not torch.compiler.is_compiling() and length - 1 <= half_window:
        return keep_B11T
    pos_T = torch.arange(length, device=device)
    band_TT = (pos_T[:, None] - pos_T[None, :]).abs() <= half_window
    if keep_B11T is None:
        return band_TT
    return keep_B11T & (band_TT | ~keep_B11T.transpose(-1, -2))
