"""glibc's heap under a training loop: where large activations come from, and giving freed pages back.

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap`` and returns it with
``munmap`` when freed. By default the threshold is dynamic: the first free of an mmapped block raises it to that
block's size, but only up to 32 MiB on 64-bit, so every larger tensor (BERT-small's FFN activations of a 4,096-token
micro-batch, 34 MB; the MLM logits, 73 MB) is a fresh mapping whose pages fault in again at every step: a tenth of a
CPU step (docs/performance.md). ``train.malloc_mmap_threshold_kib`` (1 GiB by default) fixes the threshold above
them, and the trim threshold at twice it (glibc's own rule for its dynamic one), so they come from the heap and stay
there between steps. A small fixed threshold does the opposite: every freed tensor goes straight back to the system
(a cached-gradient step keeps small long-lived tensors between the activations it frees, so with the heap its peak
RSS creeps with the number of chunks: a cached 2,048 peaked at 1.11x its uncached 256 with glibc's default, 0.98x
at 128 KiB), at the cost of page faults on every large allocation; ``trim`` after each chunk is the cheaper cure.
Setting the thresholds with ``mallopt`` also turns the dynamic adjustment off, as glibc's ``MALLOC_MMAP_THRESHOLD_``
variable does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
INT_MAX = 2**31 - 1


@functools.cache
def _glibc_function(name: str, argtypes: tuple):
    """libc's ``name`` with its C signature (returning int), loaded once; None where there is no such function
    (no glibc: musl, macOS)."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or None), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = list(argtypes), ctypes.c_int
    return fn


def set_mmap_threshold(kib: int) -> bool:
    """Fix glibc's mmap threshold at ``kib`` KiB for this process and its trim threshold at twice that (at most
    2 GiB - 1: mallopt takes an int), so that the heap keeps what it serves (0: leave glibc's dynamic default).
    False where there is no glibc (musl, macOS), where glibc refuses the value, or where the user fixed the
    threshold already with ``MALLOC_MMAP_THRESHOLD_`` (theirs wins, and their ``MALLOC_TRIM_THRESHOLD_`` too)."""
    if kib <= 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = _glibc_function("mallopt", (ctypes.c_int, ctypes.c_int))
    if mallopt is None or mallopt(M_MMAP_THRESHOLD, min(kib * 1024, INT_MAX)) != 1:
        return False
    if "MALLOC_TRIM_THRESHOLD_" not in os.environ:
        mallopt(M_TRIM_THRESHOLD, min(2 * kib * 1024, INT_MAX))
    return True


def trim() -> bool:
    """glibc's ``malloc_trim(0)``: give every whole free page of every arena back to the system (the heap's top and,
    since glibc 2.8, free pages inside it). False where there is no glibc."""
    malloc_trim = _glibc_function("malloc_trim", (ctypes.c_size_t,))
    return malloc_trim is not None and malloc_trim(0) == 1
