"""Dropout on the CPU at about 40% of torch's cost: masks from 16 random bits per element.

torch's CPU dropout draws one Bernoulli sample per element from its MT19937 generator (``bernoulli_``, ~10 ns an
element: 60x the multiply it masks, a tenth of a mini model's training step; docs/performance.md). Here one 64-bit
draw gives four elements 16 bits each, and an element is kept where its bits, read as int16, reach a threshold: the
drop probability is p rounded to a multiple of 1/65536 (p = 0.1 drops 6554/65536 = 0.100006) and the kept elements
are scaled by the inverse of the exact keep probability, so the expectation is exact. Only the boolean mask of the
kept elements is kept for the backward, as torch's dropout keeps it, and both passes multiply by it read as bytes
(``mul`` by a uint8 tensor, then by the scale: half the cost of ``masked_fill_`` with a boolean mask, which torch's
CPU kernel does not vectorise; the same values, a dropped element of a negative input being -0.0).

The 64-bit draws come from numpy's SFC64 (a third of the time of torch's MT19937 ``random_`` over the int64 range),
seeded for each mask by 128 bits drawn from torch's default CPU generator, so that generator alone decides every
mask: ``training.step.dropout_rng`` keys it by (seed, step, rank) as it keys torch's dropout, and a resume is as
exact. On CUDA (torch's dropout is one fused Philox kernel there) and inside torch.compile (inductor draws its own
noise) torch's dropout runs. ``train.fast_dropout=false`` runs torch's everywhere (``set_fast_dropout``).

Below ``FAST_MIN_NUMEL`` elements torch's dropout runs too: drawing a mask here costs a fixed ~0.15 ms of host work
(the generator's seeding, a custom autograd function, a few more ops) that a small tensor's Bernoulli samples do not
repay (2-core AMD EPYC, one thread, forward + backward: 0.26-0.53x torch's speed at 2k-8k elements, 1.1-1.7x at 32k,
1.6-2x at 64k; docs/performance.md). The unpadded path's attention groups are the exception: their masks are drawn
for the whole layer at once (``group_masks``), so that fixed cost is paid once a layer, and every group, however
small, takes this module's masks.

Attention-probability dropout lives inside SDPA, whose CPU path with dropout is the math one (scores, softmax,
``bernoulli_``, matmul); ``attention`` runs that same math with this mask instead.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

LEVELS = 1 << 16
"""Resolution of the drop probability: 16 bits per element."""

FAST_MIN_NUMEL = 1 << 15
"""The fewest elements (of the tensor dropped; for attention, of the probabilities) for which the mask is drawn
here; a smaller tensor gets torch's dropout, which costs the host less than this module's fixed overhead."""


def keep_mask(shape, p: float, device) -> tuple[torch.Tensor, float]:
    """(bool mask of ``shape``, True where an element is kept, and the scale of the kept ones): each element
    dropped with probability round(p * 65536) / 65536, independently; one int64 draw per four elements."""
    n = math.prod(shape)
    drop = round(p * LEVELS)
    words = _words((n + 3) // 4, device)
    kept = words.view(torch.int16)[:n].view(shape) >= drop - LEVELS // 2
    return kept, LEVELS / (LEVELS - drop)


def keep_masks(shapes: list[tuple[int, ...]], p: float, device) -> tuple[list[torch.Tensor], float]:
    """``keep_mask`` for several tensors at once (a layer's attention groups): one draw of words and one
    comparison for all, each mask a view of its run. Per mask that saves the generator's seeding, the draw and
    the comparison's call (~70 us on the CPU: ModernBERT mini has 16 groups in each of 4 layers)."""
    sizes = [math.prod(s) for s in shapes]
    kept, scale = keep_mask((sum(sizes),), p, device)
    return [k.view(s) for k, s in zip(kept.split(sizes), shapes)], scale


def _words(count: int, device) -> torch.Tensor:
    """``count`` uniform int64 words: on the CPU from SFC64 seeded by torch's default generator (128 bits; read
    through ``.numpy()``, no ``.item()``: no op that would be a host sync on a device), elsewhere ``random_``."""
    if torch.device(device).type != "cpu":
        return torch.empty(count, dtype=torch.int64, device=device).random_(-2**63, 2**63 - 1)
    seed = torch.empty(2, dtype=torch.int64).random_(-2**63, 2**63 - 1)
    return torch.from_numpy(np.random.SFC64(seed.numpy().view(np.uint64)).random_raw(count).view(np.int64))


def _keep_scale(x: torch.Tensor, kept: torch.Tensor, scale: float) -> torch.Tensor:
    """x * scale where ``kept``, 0 elsewhere: two vectorised multiplies (the mask read as uint8)."""
    return x.mul(kept.view(torch.uint8)).mul_(scale)


class _DropScale(torch.autograd.Function):
    """x * scale with the elements outside ``kept`` 0, saving only the boolean mask for the backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, kept: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(kept)
        ctx.scale = scale
        return _keep_scale(x, kept, scale)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (kept,) = ctx.saved_tensors
        return _keep_scale(grad, kept, ctx.scale), None, None


def uses_fast(x: torch.Tensor, p: float, training: bool, fast: bool, numel: int | None = None) -> bool:
    """Whether ``dropout`` draws its own mask: training, 0 < p < 1, on the CPU, not being compiled, and a mask of
    at least ``FAST_MIN_NUMEL`` elements (``numel``, by default ``x``'s). Compiling is asked first: a size compared
    while tracing would be a guard on the batch's shape, and a batch on the other side of the threshold a
    recompile (the compiled step's one-graph test caught it)."""
    return (fast and training and not torch.compiler.is_compiling() and 0.0 < p < 1.0
            and x.device.type == "cpu" and (x.numel() if numel is None else numel) >= FAST_MIN_NUMEL)


def dropout(x: torch.Tensor, p: float, training: bool = True, fast: bool = True) -> torch.Tensor:
    """``F.dropout(x, p, training)``; with ``fast``, on the CPU the mask comes from ``keep_mask``."""
    if not uses_fast(x, p, training, fast):
        return F.dropout(x, p, training)
    kept, scale = keep_mask(x.shape, p, x.device)
    return _DropScale.apply(x, kept, scale)


class Dropout(nn.Module):
    """``nn.Dropout`` (no state: the state dict is unchanged) drawing its CPU masks with ``keep_mask`` while
    ``fast_dropout`` (set for a whole model by ``set_fast_dropout``)."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.p = p
        self.fast_dropout = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dropout(x, self.p, self.training, self.fast_dropout)

    def extra_repr(self) -> str:
        return f"p={self.p}, fast={self.fast_dropout}"


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, dropout_p: float,
              fast: bool = True, q_scaled: bool = False,
              kept: tuple[torch.Tensor, float] | None = None) -> torch.Tensor:
    """``F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)`` (a boolean mask is True
    where a key may be attended to; a float one is added). With dropout on the CPU and ``fast``, SDPA's math path
    written out (scores, masked softmax, this module's dropout of the probabilities, matmul): the same tensors
    kept for the backward; bf16/fp16 inputs computed in fp32 and the output cast back, as that path does on the
    CPU. A row with no key to attend to gets weights over its masked keys, not NaN (such a row is padding, read by
    no loss). q and k may come in fp32 with a bf16/fp16 v (``attention_dtype``: RoPE's fp32 output); the output
    has v's dtype, and where SDPA runs q and k are cast to it first. ``q_scaled``: q comes multiplied by
    1/sqrt(K) already (a rotary layer's tables carry the factor: one pass over q and its gradient fewer).
    ``kept``: the probabilities' keep mask and scale drawn beforehand (``group_masks``), used whatever the size."""
    dtype = v.dtype
    if kept is None and not uses_fast(q, dropout_p, True, fast, q.numel() // q.shape[-1] * k.shape[-2]):
        q, k = q.to(dtype), k.to(dtype)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p,
                                              scale=1.0 if q_scaled else None)
    if dtype in (torch.bfloat16, torch.float16):
        q, k, v = q.float(), k.float(), v.float()
        mask = mask if mask is None or mask.dtype == torch.bool else mask.float()
    with torch.autocast("cpu", enabled=False):  # under autocast too: fp32 matmuls, as inside SDPA
        scores = (q if q_scaled else q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        if mask is not None:
            scores = (scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool
                      else scores + mask)
        probs = scores.softmax(-1)
        probs = dropout(probs, dropout_p) if kept is None else _DropScale.apply(probs, *kept)
        return (probs @ v).to(dtype)


def group_masks(shapes: list[tuple[int, int]], heads: int, dropout_p: float, fast: bool,
                x: torch.Tensor) -> list[tuple[torch.Tensor, float] | None]:
    """Per attention group of (n, t) rows and length, the keep mask of its (n, heads, t, t) probabilities and the
    scale (``attention(..., kept=)``), drawn for the whole layer at once (``keep_masks``) where ``attention``
    would draw them itself (``uses_fast`` on ``x``, the layer's input: training, the CPU, ``fast``, not
    compiled); else None for each group."""
    if not uses_fast(x, dropout_p, True, fast, FAST_MIN_NUMEL):
        return [None] * len(shapes)
    masks, scale = keep_masks([(n, heads, t, t) for n, t in shapes], dropout_p, x.device)
    return [(m, scale) for m in masks]


def attention_dtype(x: torch.Tensor, dropout_p: float, fast: bool = True) -> torch.dtype:
    """The dtype in which ``attention`` would like q and k: fp32 where it computes bf16/fp16 inputs in fp32 itself
    (dropout on, on the CPU, ``fast``, not compiled; it casts them to v's dtype where a small tensor takes SDPA
    after all), else x's. A rotary layer writes q and k in it (``rotary.apply_rope``): ModernBERT mini's bf16 step
    on the CPU rounded q and k to bf16 after RoPE and cast them back to fp32 here, and their gradients the other
    way, 4 casts of each a group (docs/performance.md)."""
    low = x.dtype in (torch.bfloat16, torch.float16)
    return torch.float32 if low and uses_fast(x, dropout_p, True, fast, FAST_MIN_NUMEL) else x.dtype


def set_fast_dropout(module: nn.Module, on: bool) -> None:
    """``train.fast_dropout``: every submodule with a ``fast_dropout`` switch (``Dropout``, the attention layers)
    set to ``on``."""
    for m in module.modules():
        if hasattr(m, "fast_dropout"):
            m.fast_dropout = on
