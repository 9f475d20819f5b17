"""glibc's heap under a training loop: a fixed mmap threshold, so freed activations go back to the system.

glibc serves an allocation of at least ``M_MMAP_THRESHOLD`` bytes with its own ``mmap`` and returns it with
``munmap`` when freed. By default the threshold is dynamic: the first free of an mmapped block raises it to that
block's size (up to 32 MiB on 64-bit), and from then on activations come from the heap. A cached-gradient step
keeps small long-lived tensors (each chunk's embeddings and their gradient) between the activations it frees, so the
freed space cannot be trimmed and the peak RSS creeps with the number of chunks (docs/performance.md: a cached 2,048
peaked at 1.11x its uncached 256 by default, 0.98x with a fixed 128 KiB threshold). Setting the threshold with
``mallopt`` also turns the dynamic adjustment off, as glibc's ``MALLOC_MMAP_THRESHOLD_`` variable does.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os

M_MMAP_THRESHOLD = -3  # <malloc.h>


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
    """Fix glibc's mmap threshold at ``kib`` KiB for this process (0: leave glibc's dynamic default). False where
    there is no glibc (musl, macOS) or where the user fixed it already with ``MALLOC_MMAP_THRESHOLD_`` (theirs wins)."""
    if kib <= 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    mallopt = _glibc_function("mallopt", (ctypes.c_int, ctypes.c_int))
    return mallopt is not None and mallopt(M_MMAP_THRESHOLD, kib * 1024) == 1  # glibc: 0 for a value above its max


def trim() -> bool:
    """glibc's ``malloc_trim(0)``: give every whole free page of every arena back to the system (the heap's top and,
    since glibc 2.8, free pages inside it). False where there is no glibc."""
    malloc_trim = _glibc_function("malloc_trim", (ctypes.c_size_t,))
    return malloc_trim is not None and malloc_trim(0) == 1
