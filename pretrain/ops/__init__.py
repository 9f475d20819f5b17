"""Fused in-batch similarity/softmax: CUDA kernels (csrc/) or the chunked torch path, chosen by `impl`."""

from pretrain.ops.extension import cuda_available
from pretrain.ops.margin import SIN_FLOOR, arc_margin
from pretrain.ops.similarity import IMPLS, info_nce_rows, nt_xent_rows, resolve_impl

__all__ = [
    "IMPLS", "SIN_FLOOR", "arc_margin", "cuda_available", "info_nce_rows", "nt_xent_rows", "resolve_impl",
]
