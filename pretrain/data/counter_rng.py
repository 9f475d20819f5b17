"""Counter-based random numbers for the sample pipeline: draw ``j`` of stream ``s`` of a sample is a hash of
(the sample's key, s, j), so a sample's noise depends only on its key, never on the batch, the worker or
the order it is computed in, and a whole micro-batch's draws are one vectorised numpy expression.

Shape legend: B = samples, J = draws per sample.

A generator object per sample (``np.random.default_rng([seed, epoch, index]).spawn(3)``) costs ~60 µs, more
than the augmentation itself; hashing counters costs ~10 ns a draw. The hash is SplitMix64's finaliser
(Steele, Lea & Flood 2014), a bijection of 64-bit words whose output passes BigCrush on a counter input.
"""

from __future__ import annotations

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)
_MASK64 = (1 << 64) - 1


def mix64(x: np.ndarray) -> np.ndarray:
    """SplitMix64 finaliser of a uint64 array (a new array; arithmetic wraps modulo 2**64)."""
    x = x ^ (x >> np.uint64(30))
    x *= _M1
    x ^= x >> np.uint64(27)
    x *= _M2
    x ^= x >> np.uint64(31)
    return x


def sample_keys(seed: int, epoch_B, index_B) -> np.ndarray:
    """uint64 [B]: the key of each sample (seed, epoch, index); distinct triples give unrelated keys."""
    index_B = np.asarray(index_B, dtype=np.uint64)
    epoch_B = np.broadcast_to(np.asarray(epoch_B, dtype=np.uint64), index_B.shape)
    with np.errstate(over="ignore"):
        h = mix64(np.full(index_B.shape, int(seed) & _MASK64, dtype=np.uint64) + _GOLDEN)
        h = mix64(h + (epoch_B + np.uint64(1)) * _GOLDEN)
        return mix64(h + (index_B + np.uint64(1)) * _GOLDEN)


def derive(keys_B: np.ndarray, tag: int) -> np.ndarray:
    """uint64 [B]: keys of an independent sub-stream family ``tag`` of each sample (e.g. one per view)."""
    with np.errstate(over="ignore"):
        return mix64(keys_B + np.uint64(tag) * _M1 + _M2)


def _hash(keys_B: np.ndarray, stream: int, n: int) -> np.ndarray:
    counter_J = (np.uint64(stream) << np.uint64(32)) + np.arange(1, n + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        return mix64(keys_B[:, None] + counter_J * _GOLDEN)


def draws(keys_B: np.ndarray, stream: int, n: int) -> np.ndarray:
    """float64 [B, n] uniform on [0, 1): column j of row b is draw j of stream ``stream`` of sample b.

    Column j does not depend on ``n``: a sample asks for as many draws as the widest row of its batch needs
    and uses its own first few."""
    return (_hash(keys_B, stream, n) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def draw_keys(keys_B: np.ndarray, stream: int, n: int) -> np.ndarray:
    """uint64 [B, n] sort keys: the top 48 bits of the same hash as ``draws``, the column in the low 16.

    Distinct within a row (for n <= 65536), so "the k smallest" and "the order" of a row are the same
    whatever algorithm finds them (partition or sort) and whatever the padded width; ordering by them is
    ordering by a uniform draw, ties broken by column."""
    if n > 1 << 16:
        raise ValueError(f"draw_keys supports rows of at most 65536 columns, got {n}")
    return (_hash(keys_B, stream, n) & ~np.uint64(0xFFFF)) | np.arange(n, dtype=np.uint64)
