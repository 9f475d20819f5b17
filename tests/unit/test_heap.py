"""training/heap.py: the fixed mmap threshold really changes where glibc puts a freed-then-reallocated block."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pretrain.config import load_run_config

REPO = Path(__file__).resolve().parents[2]

# In a fresh interpreter: free one 16 MiB block (mmapped; with glibc's dynamic threshold this raises the threshold
# to 16 MiB: the dynamic rule applies up to 32 MiB), then allocate 1 MiB and report whether it was mmapped
# (mallinfo2's hblks grew).
PROBE = r"""
import ctypes, sys
sys.path.insert(0, sys.argv[2])
from pretrain.training.heap import set_mmap_threshold
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                               "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallinfo2.restype = MallInfo2
applied = set_mmap_threshold(int(sys.argv[1]))
libc.free(libc.malloc(16 << 20))
before = libc.mallinfo2().hblks
p = libc.malloc(1 << 20)
print(int(applied), int(libc.mallinfo2().hblks > before))
libc.free(p)
"""


def _probe(kib: int, **env) -> tuple[int, int]:
    environ = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"} | env
    out = subprocess.run([sys.executable, "-c", PROBE, str(kib), str(REPO)], capture_output=True, text=True,
                         env=environ, timeout=60, check=True).stdout.split()
    return int(out[0]), int(out[1])


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc only")
def test_a_fixed_threshold_keeps_mmapping_after_a_large_free():
    assert _probe(0) == (0, 0)  # glibc's default: after the 16 MiB free, 1 MiB comes from the heap
    assert _probe(128) == (1, 1)  # fixed at 128 KiB: still mmapped, so its free returns it to the system
    assert _probe(128, MALLOC_MMAP_THRESHOLD_="134217728") == (0, 0)  # the user's variable wins (128 MiB)


# In a fresh interpreter: a 64 MiB block (over glibc's 32 MiB cap on its dynamic threshold) allocated, touched and
# freed twice; the page faults of the second round (getrusage's minor faults).
FAULT_PROBE = r"""
import ctypes, resource, sys
sys.path.insert(0, sys.argv[2])
from pretrain.training.heap import set_mmap_threshold
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
applied = set_mmap_threshold(int(sys.argv[1]))
def round_():
    p = libc.malloc(64 << 20)
    ctypes.memset(p, 1, 64 << 20)
    libc.free(p)
round_()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
round_()
print(int(applied), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc only")
def test_the_default_threshold_keeps_a_large_block_in_the_heap_between_steps():
    """glibc's default maps a 64 MiB tensor afresh each time and faults its 16,384 pages in again; the trainer's
    default serves it from the heap the second time, with its pages still there (mmap and trim thresholds both)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}

    def faults(kib: int) -> tuple[int, int]:
        out = subprocess.run([sys.executable, "-c", FAULT_PROBE, str(kib), str(REPO)], capture_output=True,
                             text=True, env=env, timeout=60, check=True).stdout.split()
        return int(out[0]), int(out[1])

    default = load_run_config(None, []).train.malloc_mmap_threshold_kib
    assert default >= 64 << 10
    applied, kept = faults(default)
    if not applied:
        pytest.skip("this glibc refuses an mmap threshold of 1 GiB (older ones cap it at 32 MiB)")
    assert kept < 1000, kept
    applied, mapped = faults(0)
    assert applied == 0 and mapped > 15000, mapped  # 64 MiB / 4 KiB pages


def test_the_setting_defaults_to_1_gib_and_refuses_a_negative():
    assert load_run_config(None, []).train.malloc_mmap_threshold_kib == 1 << 20
    assert load_run_config(None, ["train.malloc_mmap_threshold_kib=0"]).train.malloc_mmap_threshold_kib == 0
    assert load_run_config(None, ["train.malloc_mmap_threshold_kib=128"]).train.malloc_mmap_threshold_kib == 128
    with pytest.raises(ValueError, match="malloc_mmap_threshold_kib"):
        load_run_config(None, ["train.malloc_mmap_threshold_kib=-1"])


# In a fresh interpreter: 200 blocks of 1 MiB from the heap (the mmap threshold fixed above them), each touched;
# every other one is freed, so the freed ones are holes between live blocks that neither coalesce nor reach the
# heap's top (free() gives back only the top); then RSS before and after trim().
TRIM_PROBE = r"""
import ctypes, sys
sys.path.insert(0, sys.argv[1])
from pretrain.training.heap import trim
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
assert libc.mallopt(-3, 16 << 20) == 1  # M_MMAP_THRESHOLD (at most 32 MiB): 1 MiB blocks come from the heap
def rss_mib():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
blocks = []
for _ in range(200):
    p = libc.malloc(1 << 20)
    ctypes.memset(p, 1, 1 << 20)
    blocks.append(p)
for p in blocks[::2]:
    libc.free(p)
before = rss_mib()
print(int(trim()), before, rss_mib())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux") or os.confstr("CS_GNU_LIBC_VERSION") is None,
                    reason="glibc only")
def test_trim_gives_back_freed_pages_inside_the_heap():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", TRIM_PROBE, str(REPO)], capture_output=True, text=True, env=env,
                         timeout=60, check=True).stdout.split()
    trimmed, before, after = int(out[0]), float(out[1]), float(out[2])
    assert trimmed == 1
    assert before - after > 80, (before, after)  # ~100 MiB of freed, touched pages were still resident


def test_the_trim_setting_defaults_on():
    assert load_run_config(None, []).train.malloc_trim_chunks is True
