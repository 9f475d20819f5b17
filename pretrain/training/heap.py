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
import os

M_MMAP_THRESHOLD = -3  # <malloc.h>


def set_mmap_threshold(kib: int) -> bool:
    """Fix glibc's mmap threshold at ``kib`` KiB for this process (0: leave glibc's dynamic default). False where
    there is no glibc (musl, macOS) or where the user fixed it already with ``MALLOC_MMAP_THRESHOLD_`` (theirs wins)."""
    if kib <= 0 or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or None)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, kib * 1024) == 1  # glibc: 1 on success, 0 for a value above its maximum


_LIBC = None


def trim() -> bool:
    """glibc's ``malloc_trim(0)``: give every whole free page of every arena back to the system (the heap's top and,
    since glibc 2.8, free pages inside it). False where there is no glibc."""
    global _LIBC
    if _LIBC is None:
        try:
            _LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None)
            _LIBC.malloc_trim.argtypes, _LIBC.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        except (OSError, AttributeError):
            _LIBC = False
    return bool(_LIBC) and _LIBC.malloc_trim(0) == 1
