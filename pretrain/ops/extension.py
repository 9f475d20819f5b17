"""Finding the compiled CUDA kernels: the prebuilt `pretrain._C` (from `pip install`) or a JIT build.

The extension registers `torch.ops.pretrain_cuda.masked_lse_fwd/_bwd` (CUDA kernels, csrc/); it is
built by setup.py only when a CUDA torch and nvcc are present, so on CPU machines it is absent and
everything falls back to the chunked torch path.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path

CSRC_DIR = Path(__file__).resolve().parents[2] / "csrc"
SOURCES = ("similarity_ops.cpp", "similarity_kernels.cu")
NVCC_FLAGS = ("-O3", "--use_fast_math", "-lineinfo")  # torch picks the C++ standard


def _registered() -> bool:
    import torch

    try:
        torch.ops.pretrain_cuda.masked_lse_fwd  # noqa: B018 - attribute lookup is the check
    except (AttributeError, RuntimeError):
        return False
    return True


@functools.cache
def _load_prebuilt() -> bool:
    try:
        importlib.import_module("pretrain._C")
    except ImportError:
        return False
    return True


def cuda_available() -> bool:
    """True when the CUDA extension is built and loaded (prebuilt or JIT); says nothing about a GPU."""
    return _load_prebuilt() or _registered()


def build_jit(verbose: bool = False, build_dir: str | None = None) -> None:
    """Compile csrc/ with torch.utils.cpp_extension.load and register its ops (needs nvcc + CUDA torch)."""
    import torch
    from torch.utils import cpp_extension

    if cuda_available():
        return
    if torch.version.cuda is None:
        raise ValueError("the JIT build needs a CUDA build of torch; this torch is CPU-only")
    sources = [CSRC_DIR / name for name in SOURCES]
    missing = [str(p) for p in sources if not p.is_file()]
    if missing:
        raise FileNotFoundError(f"CUDA sources not found: {missing}; the JIT build needs a source checkout")
    cpp_extension.load(
        name="pretrain_cuda_jit",
        sources=[str(p) for p in sources],
        extra_cflags=["-O3"],
        extra_cuda_cflags=list(NVCC_FLAGS),
        build_directory=build_dir,
        is_python_module=False,
        verbose=verbose,
    )
