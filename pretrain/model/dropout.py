"""Dropout on the CPU in one pass, its mask a hash of a counter: nothing stored between forward and backward.

torch's CPU dropout draws one Bernoulli sample per element from its MT19937 generator (``bernoulli_``, ~10 ns an
element: 60x the multiply it masks, a tenth of a mini model's training step; docs/performance.md) and keeps the
mask for the backward. Here a mask is two numbers, a 64-bit key drawn from torch's default CPU generator and a
first word (``Mask``): word w is SplitMix64's hash of key + w * GAMMA (Steele, Lea & Flood 2014: SplitMix64's own
output sequence, read as counters, as Philox is on CUDA), one word gives four elements 16 bits each, and an element
is kept where its bits, read as int16, reach a threshold. The drop probability is p rounded to a multiple of
1/65536 (p = 0.1 drops 6554/65536 = 0.100006) and the kept elements are scaled by the inverse of the exact keep
probability, so the expectation is exact. The C kernel (csrc/cpu/model_kernels.c, ``pretrain.model._kernels``)
computes the words, compares and scales in one pass over the tensor, forward and backward alike (the backward
computes the same mask again from the key); without it (no C compiler at install) ``mask_words`` computes the same
bits with torch's int64 ops, slower. A dropped element is x * 0, as in torch (-0.0 for a negative x, NaN for a
non-finite one).

torch's default generator alone decides every key: ``training.step.dropout_rng`` keys it by (seed, step, rank) as
it keys torch's dropout, and a resume is as exact; a mask does not depend on the thread count. On CUDA (torch's
dropout is one fused Philox kernel there) and inside torch.compile (inductor draws its own noise) torch's dropout
runs. ``train.fast_dropout=false`` runs torch's everywhere (``set_fast_dropout``).

Below ``FAST_MIN_NUMEL`` elements torch's dropout runs too: a mask here costs a fixed host overhead (the key's
draw, a custom autograd function) that a small tensor's Bernoulli samples do not repay (docs/performance.md). The
unpadded path's attention groups are the exception: their masks are runs of one key drawn for the whole layer
(``group_masks``), so that fixed cost is paid once a layer, and every group, however small, takes this module's
masks.

Attention-probability dropout lives inside SDPA, whose CPU path with dropout is the math one (scores, softmax,
``bernoulli_``, matmul); ``attention`` runs that same math with this mask instead.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.weak import WeakIdKeyDictionary

from pretrain.model.kernels import KINDS, cpu_kernels

LEVELS = 1 << 16
"""Resolution of the drop probability: 16 bits per element."""

FAST_MIN_NUMEL = 1 << 13
"""The fewest elements (of the tensor dropped; for attention, of the probabilities) for which the mask is drawn
here; a smaller tensor gets torch's dropout, which costs the host less than this module's fixed overhead (forward +
backward, 2-core Intel Xeon, 2026-11-29: 0.7x torch's speed at 1k elements, 1.0x at 4k, 1.4x at 8k, 2-3.4x at
16k-64k; was 32k when the mask cost a seeded SFC64 draw and a comparison)."""

GAMMA = 0x9E3779B97F4A7C15
"""SplitMix64's increment (2^64 / the golden ratio, odd): word w of a mask hashes key + w * GAMMA."""

_MIX = (30, 0xBF58476D1CE4E5B9, 27, 0x94D049BB133111EB, 31)
"""SplitMix64's finaliser (Stafford's variant 13): xor-shift, multiply, xor-shift, multiply, xor-shift."""


class Mask(NamedTuple):
    """A dropout mask as the two numbers it is computed from, and its rate: element i of the masked tensor (in
    memory order) is kept iff bits 16 * (i % 4) .. + 15 of ``splitmix64(key + (first + i // 4) * GAMMA)``, read as
    an int16, are >= ``threshold``; kept elements are multiplied by ``scale``. Nothing else is kept between the
    forward and the backward."""

    key: int
    """64 bits, drawn from torch's default generator (``draw``), held as a signed int64 (the kernel reads the same
    bits unsigned): a Python int beyond int64 in an autograd function's arguments makes ``torch.profiler``'s
    ``record_shapes`` fail the step."""
    first: int
    """The mask's first word: several masks of one key are consecutive runs of its words (``draw_masks``)."""
    threshold: int
    scale: float


def _rate(p: float) -> tuple[int, float]:
    """(threshold, scale) of drop probability p: round(p * 65536) / 65536 dropped, the kept scaled by the inverse of
    the exact keep probability."""
    drop = round(p * LEVELS)
    return drop - LEVELS // 2, LEVELS / (LEVELS - drop)


def _key() -> int:
    """64 random bits from torch's default CPU generator (read through ``.numpy()``, no ``.item()``: no op that
    would be a host sync on a device), so that generator alone decides every mask."""
    return int(torch.empty(1, dtype=torch.int64).random_(-2**63, 2**63 - 1).numpy()[0])


def draw(p: float) -> Mask:
    """A fresh mask of drop probability p (any size: its words are computed where it is applied)."""
    return Mask(_key(), 0, *_rate(p))


def draw_masks(numels: list[int], p: float) -> list[Mask]:
    """Masks for several tensors at once (a layer's attention groups): one key, each tensor's mask the next run of
    its words (whole words: a mask starts at an element that is a multiple of 4). Per mask that saves drawing the
    key (~10 us on the CPU: ModernBERT mini has 16 groups in each of 4 layers)."""
    if not numels:
        return []
    key, (threshold, scale) = _key(), _rate(p)
    firsts = itertools.accumulate([(n + 3) // 4 for n in numels[:-1]], initial=0)
    return [Mask(key, first, threshold, scale) for first in firsts]


def _signed(u: int) -> int:
    return u - 2**64 if u >= 2**63 else u


def mask_words(key: int, first: int, count: int, device="cpu") -> torch.Tensor:
    """Words first .. first + count - 1 of key's mask (int64), computed with torch's int64 ops (which wrap, as
    uint64 arithmetic does; a logical shift is the arithmetic one with the sign bits cleared). The reference the C
    kernel is tested against, and the path where it is not built or cannot run."""
    z = torch.arange(first, first + count, dtype=torch.int64, device=device) * _signed(GAMMA) + _signed(key)
    s1, m1, s2, m2, s3 = _MIX
    for shift, mul in ((s1, m1), (s2, m2), (s3, None)):
        z = z ^ ((z >> shift) & ((1 << (64 - shift)) - 1))
        if mul is not None:
            z = z * _signed(mul)
    return z


def kept_of(mask: Mask, shape, device="cpu") -> torch.Tensor:
    """The boolean mask (True = kept) of a tensor of ``shape`` under ``mask``."""
    n = math.prod(shape)
    words = mask_words(mask.key, mask.first, (n + 3) // 4, device)
    return words.view(torch.int16)[:n].view(shape) >= mask.threshold


def keep_mask(shape, p: float, device) -> tuple[torch.Tensor, float]:
    """(bool mask of ``shape``, True where an element is kept, and the scale of the kept ones) of a fresh ``draw``:
    each element dropped with probability round(p * 65536) / 65536, independently."""
    mask = draw(p)
    return kept_of(mask, shape, device), mask.scale


def scale_masked(x: torch.Tensor, mask: Mask) -> torch.Tensor:
    """x * scale where ``mask`` keeps an element, x * 0 elsewhere (-0.0 for a negative x, NaN for a non-finite
    one, as torch's dropout): in one pass of the C kernel for a CPU float32/bfloat16 tensor (made contiguous; a
    gradient may come as a strided view), else with ``kept_of``'s boolean mask (the same bits)."""
    kernel = cpu_kernels()
    if kernel is None or x.device.type != "cpu" or x.dtype not in KINDS or x.numel() == 0:
        return x.mul(kept_of(mask, x.shape, x.device).view(torch.uint8)).mul_(mask.scale)
    x = x.contiguous()
    y = torch.empty_like(x, memory_format=torch.contiguous_format)
    kernel.scale_masked(x.data_ptr(), y.data_ptr(), x.numel(), KINDS[x.dtype], mask.key, mask.first,
                        mask.threshold, mask.scale, torch.get_num_threads())
    return y


class _DropScale(torch.autograd.Function):
    """``scale_masked`` of x, keeping nothing for the backward but the mask's numbers (the backward computes the
    same mask again: cheaper than reading a stored one back, and no activation memory)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: Mask) -> torch.Tensor:
        ctx.mask = mask
        return scale_masked(x, mask)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return scale_masked(grad, ctx.mask), None


def uses_fast(x: torch.Tensor, p: float, training: bool, fast: bool, numel: int | None = None) -> bool:
    """Whether ``dropout`` draws its own mask: training, a p that 16 bits round to neither 0 nor 1, on the CPU,
    not being compiled, and a mask of at least ``FAST_MIN_NUMEL`` elements (``numel``, by default ``x``'s).
    Compiling is asked first: a size compared while tracing would be a guard on the batch's shape, and a batch on
    the other side of the threshold a recompile (the compiled step's one-graph test caught it)."""
    return (fast and training and not torch.compiler.is_compiling() and 0 < round(p * LEVELS) < LEVELS
            and x.device.type == "cpu" and (x.numel() if numel is None else numel) >= FAST_MIN_NUMEL)


def dropout(x: torch.Tensor, p: float, training: bool = True, fast: bool = True) -> torch.Tensor:
    """``F.dropout(x, p, training)``; with ``fast``, on the CPU a hashed mask (``draw``) applied by ``_DropScale``."""
    if not uses_fast(x, p, training, fast):
        return F.dropout(x, p, training)
    return _DropScale.apply(x, draw(p))


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
              kept: Mask | None = None) -> torch.Tensor:
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
        return F.scaled_dot_product_attention(q, k, v, attn_mask=sdpa_bias(mask, dtype), dropout_p=dropout_p,
                                              scale=1.0 if q_scaled else None)
    # v is often a view of a fused projection (ModernBERT's, whose RoPE rewrites q and k only): matmul would copy it
    # apart in the forward and again in the backward's grad v^T; copied once here, both multiply the copy as it is
    v = v.contiguous()
    if dtype in (torch.bfloat16, torch.float16):
        q, k, v = q.float(), k.float(), v.float()
        mask = mask if mask is None or mask.dtype == torch.bool else mask.float()
    with torch.autocast("cpu", enabled=False):  # under autocast too: fp32 matmuls, as inside SDPA
        if _probs_in_c(q, k, v, mask):  # scale, mask, softmax and dropout in one pass each way
            return _Attention.apply(q, k, v, mask, 1.0 if q_scaled else q.shape[-1] ** -0.5,
                                    draw(dropout_p) if kept is None else kept).to(dtype)
        scores = (q if q_scaled else q * q.shape[-1] ** -0.5) @ k.transpose(-2, -1)
        if mask is not None:
            scores = (scores.masked_fill(~mask, torch.finfo(scores.dtype).min) if mask.dtype == torch.bool
                      else scores + mask)
        probs = scores.softmax(-1)
        probs = dropout(probs, dropout_p) if kept is None else _DropScale.apply(probs, kept)
        return (probs @ v).to(dtype)


BIAS_ALIGNMENT = 8
"""The multiple that CUDA's memory-efficient SDPA wants every stride of an additive mask but the last to be (aten's
``preprocess_mask``), else it pads the mask on every call."""

_BIASES = WeakIdKeyDictionary()
"""A boolean mask tensor -> ((dtype, version, inference mode), its ``sdpa_bias``): one entry per live mask."""


def sdpa_bias(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """What SDPA makes of a boolean key ``mask`` (True: attend) on every call, made once per mask tensor: the additive
    bias in ``dtype``, 0 where ``mask`` is True and -inf where it is False, in a buffer whose last dimension is
    padded to a multiple of ``BIAS_ALIGNMENT`` and sliced back (every stride but the last a multiple of it). Given a
    boolean mask, SDPA's front end converts it (two ``scalar_tensor``s and a ``where``) and, for the
    memory-efficient CUDA kernel (the one that takes a mask), pads and slices it (``constant_pad_nd``) on every
    call: five aten ops and about as many small CUDA kernels per attention call, where a step's key masks serve
    every layer (12 layers x each attention group). Given this bias, it only broadcasts it. The same values, so the same
    attention (tests/unit/test_fast_dropout.py). A float mask, None, or a mask inside torch.compile (which fuses the
    conversion itself) comes back as it is. The bias lives as long as its mask (a weak-keyed cache); a mask changed
    in place or read in another dtype or inference mode gets a new one."""
    if mask is None or mask.dtype != torch.bool or torch.compiler.is_compiling():
        return mask
    key = (dtype, mask._version, torch.is_inference_mode_enabled())
    hit = _BIASES.get(mask)
    if hit is not None and hit[0] == key:
        return hit[1]
    cols = mask.shape[-1]
    padded = -(-cols // BIAS_ALIGNMENT) * BIAS_ALIGNMENT
    bias = torch.full((*mask.shape[:-1], padded), float("-inf"), dtype=dtype, device=mask.device)[..., :cols]
    bias.masked_fill_(mask, 0.0)
    _BIASES[mask] = (key, bias)
    return bias


def _probs_in_c(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> bool:
    """Whether ``_Attention`` runs (the C probabilities between the two matmuls): the C module built, 4-d
    fp32 q, k and v of the same (n, heads) (none broadcast), and no mask or a boolean one whose key dimension is not
    broadcast."""
    return (cpu_kernels() is not None and q.dim() == 4 and q.dtype == k.dtype == v.dtype == torch.float32
            and q.shape[:2] == k.shape[:2] == v.shape[:2] and q.shape[-2] > 0 and k.shape[-2] > 0
            and (mask is None or (mask.dtype == torch.bool and mask.shape[-1] == k.shape[-2])))


def _kernel_mask(keep: torch.Tensor | None, shape: torch.Size) -> torch.Tensor | None:
    """A boolean key mask broadcast to the (n, heads, t, cols) scores as the C kernels read it: keys contiguous (a
    copy of the mask made so, before it is broadcast, where they are not)."""
    if keep is None:
        return None
    return (keep if keep.stride(-1) == 1 else keep.contiguous()).expand(shape)


def _probs_args(scores: torch.Tensor, keep: torch.Tensor | None, scale: float, mask: Mask) -> tuple:
    """The (rows, cols, heads, t, keep, keep strides, scale, key, first, threshold, dscale, threads) arguments of
    the C kernels for (n, heads, t, cols) scores and a ``_kernel_mask`` (which the caller holds while they run)."""
    n, heads, t, cols = scores.shape
    address, strides = (0, (0, 0, 0)) if keep is None else (keep.data_ptr(), keep.stride()[:3])
    return (n * heads * t, cols, heads, t, address, strides, scale, mask.key, mask.first, mask.threshold, mask.scale,
            torch.get_num_threads())


def _probs(scores: torch.Tensor, keep: torch.Tensor | None, scale: float,
           mask: Mask) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """softmax(scale * scores, keys masked by ``keep``) and its dropout under ``mask`` in one pass of the C kernel
    (``attention_probs``), where torch takes four (q's scaling, ``masked_fill``, softmax, dropout): (probabilities,
    dropped probabilities, the broadcast key mask the backward reads). Masked keys get float32's lowest value, as
    ``masked_fill`` gives them (a row with no key gets weights over all)."""
    scores = scores.contiguous()
    probs, dropped = torch.empty_like(scores), torch.empty_like(scores)
    keep = _kernel_mask(keep, scores.shape)
    cpu_kernels().attention_probs(scores.data_ptr(), probs.data_ptr(), dropped.data_ptr(),
                                  *_probs_args(scores, keep, scale, mask))
    return probs, dropped, keep


def _probs_grad(grad: torch.Tensor, probs: torch.Tensor, keep: torch.Tensor | None, scale: float,
                mask: Mask) -> torch.Tensor:
    """The scores' gradient for the dropped probabilities' gradient ``grad`` (``attention_probs_grad``)."""
    grad = grad.contiguous()
    out = torch.empty_like(probs)
    cpu_kernels().attention_probs_grad(grad.data_ptr(), probs.data_ptr(), out.data_ptr(),
                                       *_probs_args(probs, keep, scale, mask))
    return out


class _Attention(torch.autograd.Function):
    """dropout(softmax(scale * q k^T, keys masked by ``keep``)) v: the two matmuls around the C probabilities
    (``_probs``, ``_probs_grad``) as one autograd node. Keeps what autograd kept for the three pieces (q, k, v, the
    probabilities, as softmax keeps them, the dropped ones and the broadcast key mask); the backward is theirs, but
    k's gradient comes as the product dS^T q, contiguous, where autograd's (the transpose of q^T dS) came as a
    transposed view that the attention groups' layout copied before reading it, and the chain of views, expands and
    matmul nodes around the two products is one node."""

    @staticmethod
    def forward(ctx, q, k, v, keep, scale, mask):
        probs, dropped, keep = _probs(torch.matmul(q, k.transpose(-2, -1)), keep, scale, mask)
        ctx.save_for_backward(q, k, v, probs, dropped, keep)
        ctx.scale, ctx.mask = scale, mask
        return torch.matmul(dropped, v)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, probs, dropped, keep = ctx.saved_tensors
        need_q, need_k, need_v = ctx.needs_input_grad[:3]
        grad_v = torch.matmul(dropped.transpose(-2, -1), grad) if need_v else None
        grad_scores = _probs_grad(torch.matmul(grad, v.transpose(-2, -1)), probs, keep, ctx.scale, ctx.mask)
        grad_q = torch.matmul(grad_scores, k) if need_q else None
        grad_k = torch.matmul(grad_scores.transpose(-2, -1), q) if need_k else None
        return grad_q, grad_k, grad_v, None, None, None


def group_masks(shapes: tuple[tuple[int, int], ...], heads: int, dropout_p: float, fast: bool,
                x: torch.Tensor) -> list[Mask | None]:
    """Per attention group of (n, t) rows and length, the mask of its (n, heads, t, t) probabilities
    (``attention(..., kept=)``), drawn for the whole layer at once (``draw_masks``) where ``attention`` would draw
    them itself (``uses_fast`` on ``x``, the layer's input: training, the CPU, ``fast``, not compiled); else None
    for each group."""
    if not uses_fast(x, dropout_p, True, fast, FAST_MIN_NUMEL):
        return [None] * len(shapes)
    return draw_masks([n * heads * t * t for n, t in shapes], dropout_p)


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
