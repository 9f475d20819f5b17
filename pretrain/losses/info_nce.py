"""InfoNCE with in-batch negatives (SimCSE), optionally with ArcCon's angular margin.

Shape legend: N = local queries (view 1), M = keys (view 2 of every rank, gathered by the
caller), D = embedding dim.

Row i's positive is column ``pos_idx_N[i]`` of the keys; every other column is a negative.
``self_idx_N`` names a column to drop from row i's softmax (NT-Xent over 2N views, where
the keys contain the query itself). The per-row loss is ``pretrain.ops.info_nce_rows``
(fused CUDA kernel, chunked torch path or eager, chosen by ``impl``), which never needs
the N x M matrix outside the eager path.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pretrain.ops import info_nce_rows

Metrics = dict[str, tuple[torch.Tensor, int]]
"""name -> (sum, count) of a metric; the caller reduces sums and counts across ranks."""


def info_nce(
    q_ND: torch.Tensor,
    k_MD: torch.Tensor,
    pos_idx_N: torch.Tensor,
    *,
    temperature: float,
    margin: float = 0.0,
    self_idx_N: torch.Tensor | None = None,
    impl: str = "eager",
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, int, Metrics]:
    """-log softmax of the positive cosine / temperature, summed over rows -> (loss_sum, N, metrics).

    q and k need not be normalised (normalised here in fp32/fp64, then handed to ops in their
    own dtype). ``margin`` (radians) makes the positive logit cos(theta + margin) (ArcCon).
    """
    if temperature <= 0:
        raise ValueError(f"info_nce temperature must be > 0, got {temperature}")
    if q_ND.shape[-1] != k_MD.shape[-1]:
        raise ValueError(f"info_nce: query dim {q_ND.shape[-1]} != key dim {k_MD.shape[-1]}")
    num_rows = q_ND.shape[0]
    dtype = q_ND.dtype
    q_ND = F.normalize(_wide(q_ND), dim=-1)
    k_MD = F.normalize(_wide(k_MD), dim=-1)
    loss_N = info_nce_rows(
        q_ND.to(dtype), k_MD.to(dtype), pos_idx_N, temperature=temperature, margin=margin,
        self_idx_N=self_idx_N, impl=impl, chunk_size=chunk_size,
    )
    with torch.no_grad():
        pos_cos_N = (q_ND * k_MD[pos_idx_N]).sum(-1)
        metrics: Metrics = {
            "pos_cos": (pos_cos_N.sum(), num_rows),
            "pos_prob": (torch.exp(-loss_N.detach()).sum(), num_rows),
        }
    return loss_N.sum(), num_rows, metrics


def _wide(x: torch.Tensor) -> torch.Tensor:
    """float64 stays, everything else (bf16/fp16/fp32) is handled in float32."""
    return x if x.dtype == torch.float64 else x.float()
