"""The model's CPU kernels in C (csrc/cpu/model_kernels.c, built as ``pretrain.model._kernels`` by setup.py where a
C compiler is found): each one pass over its tensors where torch's ops take several. Callers check the tensors
(device, dtype, layout) and keep a torch path with the same results where the module is not built."""

from __future__ import annotations

import functools

import torch

KINDS = {torch.float32: 0, torch.bfloat16: 1}
"""The dtypes the kernels read and write, by the code they take."""


@functools.cache
def cpu_kernels():
    """The C module, or None where it is not built (imported after torch: it shares torch's OpenMP runtime)."""
    try:  # inside: an optional compiled module (absent where no C compiler was found at install)
        from pretrain.model import _kernels
    except ImportError:
        return None
    return _kernels
