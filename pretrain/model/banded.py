"""Sliding-window attention that computes only the band: ModernBERT's local layers at long sequences.

Shapes: B batch (or an attention group's rows), H heads, T length, K head size, w block size (= the half window),
b blocks (b * w >= T).

A local layer lets a query attend to keys within ``half`` positions. With a dense (T, T) mask SDPA still computes
all T^2 scores (as transformers' ModernBERT does outside flash-attn); here the sequence is cut into blocks of
``half`` queries, and block i attends only to key blocks i-1, i, i+1 (3 * half keys, the band masked inside it):
T * 3 * half scores instead of T^2 (at T = 1024 and window 128: 19%; at 8192: 2.3%). The keys a query may see are
exactly those of the dense window mask, so the output and gradients of every real query are the dense path's
(``tests/unit/test_banded.py`` checks both against a float64 reference). A padding query whose neighbourhood holds
no real key attends to its own slot (the dense mask lets it see every real key instead): its output is never read,
and no row is fully masked (SDPA would give NaN, which reaches the gradients).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pretrain.model.dropout import attention

MIN_BLOCKS = 6
"""The band is used from this many blocks on (T > 5 * half): below it the three key blocks are most of T and the
blocking's copies cost more than the scores saved (CPU, fp32: at half 64 the band was 1.2x slower at T = 256 and
1.2x faster at T = 384, 3x at T = 1024, forward + backward)."""


@dataclass
class Band:
    """In place of a local layer's dense mask (``make_band``): attend within ``half`` positions, to real keys.
    Built once per forward and shared by the local layers."""

    half: int
    mask_bw3: torch.Tensor
    """(rows * blocks, 1, half, 3 * half) boolean: which neighbourhood slots each query may attend to (one row
    without padding: the same for every sequence)."""


def use_band(length: int, half: int) -> bool:
    return half > 0 and -(-length // half) >= MIN_BLOCKS


def num_blocks(length: int, half: int) -> int:
    """Blocks of ``half`` that cover ``length``; in a compiled step one more where they would fit exactly, so that
    the last block is always padded: whether ``half`` divides the length (of an unpadded step's attention group,
    other in every batch) would otherwise be a guard, and each change a recompile."""
    return length // half + 1 if torch.compiler.is_compiling() else -(-length // half)


def make_band(keep_B11T: torch.Tensor | None, length: int, half: int, device: torch.device) -> Band:
    """The band of sequences of ``length`` (``keep_B11T``: True on real key slots, one row per sequence; None when
    every slot is real)."""
    w, nb = half, num_blocks(length, half)
    pad = nb * w - length
    rows = 1 if keep_B11T is None else keep_B11T.shape[0]
    real_BT = torch.ones(1, length, dtype=torch.bool, device=device) if keep_B11T is None \
        else keep_B11T.reshape(rows, length)
    real_Bb3 = F.pad(real_BT, (w, pad + w), value=False).unfold(1, 3 * w, w)  # (B, b, 3w): real neighbourhood slots
    a = torch.arange(w, device=device)
    c = torch.arange(3 * w, device=device)
    offset_w3 = c[None, :] - (a[:, None] + w)  # key position minus query position
    mask_Bbw3 = (offset_w3.abs() <= w) & real_Bb3[:, :, None, :]
    empty_Bbw = ~mask_Bbw3.any(-1)
    mask_Bbw3 = mask_Bbw3 | (empty_Bbw[..., None] & (offset_w3 == 0))  # a padding query: its own slot
    return Band(half, mask_Bbw3.reshape(rows * nb, 1, w, 3 * w))


def banded_attention(q_BHTK: torch.Tensor, k_BHTK: torch.Tensor, v_BHTK: torch.Tensor, band: Band,
                     dropout_p: float = 0.0, fast_dropout: bool = True, q_scaled: bool = False) -> torch.Tensor:
    """SDPA of queries on the keys within ``band.half`` positions (and real): (B, H, T, K); dropout on the CPU with
    ``fast_dropout`` as ``dropout.attention`` draws it; ``q_scaled`` as there."""
    bsz, heads, length, size = q_BHTK.shape
    w = band.half
    nb = num_blocks(length, w)
    pad = nb * w - length
    # Keys and values get one empty block on each side, so that every query block's neighbourhood is 3 blocks.
    kv_pad = (0, 0, w, pad + w)
    k_bH3K = F.pad(k_BHTK, kv_pad).unfold(2, 3 * w, w).permute(0, 2, 1, 4, 3).reshape(bsz * nb, heads, 3 * w, size)
    v_bH3K = F.pad(v_BHTK, kv_pad).unfold(2, 3 * w, w).permute(0, 2, 1, 4, 3).reshape(bsz * nb, heads, 3 * w, size)
    q_bHwK = F.pad(q_BHTK, (0, 0, 0, pad)).view(bsz, heads, nb, w, size).transpose(1, 2).reshape(bsz * nb, heads, w,
                                                                                                     size)
    mask = band.mask_bw3
    if mask.shape[0] != bsz * nb:  # one band for every row (no padding)
        mask = mask.view(-1, nb, 1, w, 3 * w).expand(bsz, nb, 1, w, 3 * w).reshape(bsz * nb, 1, w, 3 * w)
    y = attention(q_bHwK, k_bH3K, v_bH3K, mask, dropout_p, fast_dropout, q_scaled)
    return y.view(bsz, nb, heads, w, size).transpose(1, 2).reshape(bsz, heads, nb * w, size)[:, :, :length]
