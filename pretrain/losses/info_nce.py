"""InfoNCE with in-batch negatives (SimCSE), optionally with ArcCon's angular margin.

Shape legend: N = local queries (view 1), M = keys (view 2 of every rank, gathered by the
caller), D = embedding dim.

Row i's positive is column ``pos_idx_N[i]`` of the keys; every other column is a negative.
``self_idx_N`` names a column to drop from row i's softmax (NT-Xent over 2N views, where
the keys contain the query itself). Supervised SimCSE's hard negatives ``neg_MD`` (row j of
every rank's third sentences, gathered like the keys) are M extra columns; row i's own hard
negative (column M + pos_idx_N[i]) has its exp weighted by ``neg_weight`` (SimCSE's alpha):

    loss_i = -log e^{s_i,pos} / (sum_j e^{s_ij} + sum_j alpha^{[j = pos_i]} e^{h_ij}),
    s = cos(q, k) / tau,  h = cos(q, neg) / tau. The per-row loss is ``pretrain.ops.info_nce_rows``
(fused CUDA kernel, chunked torch path or eager, chosen by ``impl``), which never needs
the N x M matrix outside the eager path.
"""

from __future__ import annotations

import math

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
    neg_MD: torch.Tensor | None = None,
    neg_weight: float = 1.0,
    check_values: bool = True,
) -> tuple[torch.Tensor, int, Metrics]:
    """-log softmax of the positive cosine / temperature, summed over rows -> (loss_sum, N, metrics).

    q and k need not be normalised (normalised here in fp32/fp64, then handed to ops in their
    own dtype). ``margin`` (radians) makes the positive logit cos(theta + margin) (ArcCon).
    ``neg_MD``: hard negatives as extra columns, row i's own weighted by ``neg_weight`` (>= 0).
    ``check_values``: as ``info_nce_rows``' (off for indices the caller built).
    """
    if temperature <= 0:
        raise ValueError(f"info_nce temperature must be > 0, got {temperature}")
    if q_ND.shape[-1] != k_MD.shape[-1]:
        raise ValueError(f"info_nce: query dim {q_ND.shape[-1]} != key dim {k_MD.shape[-1]}")
    num_rows = q_ND.shape[0]
    dtype = q_ND.dtype
    q_ND = F.normalize(_wide(q_ND), dim=-1)
    k_MD = F.normalize(_wide(k_MD), dim=-1)
    if neg_MD is None:
        loss_N = info_nce_rows(
            q_ND.to(dtype), k_MD.to(dtype), pos_idx_N, temperature=temperature, margin=margin,
            self_idx_N=self_idx_N, impl=impl, chunk_size=chunk_size, check_values=check_values,
        )
    else:
        neg_MD = F.normalize(_wide(neg_MD), dim=-1)
        loss_N = _with_hard_negatives(q_ND, k_MD, neg_MD, pos_idx_N, temperature=temperature, margin=margin,
                                      self_idx_N=self_idx_N, weight=neg_weight, dtype=dtype, impl=impl,
                                      chunk_size=chunk_size, check_values=check_values)
    with torch.no_grad():
        pos_cos_N = (q_ND * k_MD[pos_idx_N]).sum(-1)
        metrics: Metrics = {
            "pos_cos": (pos_cos_N.sum(), num_rows),
            "pos_prob": (torch.exp(-loss_N.detach()).sum(), num_rows),
        }
        if neg_MD is not None:
            metrics["hard_neg_cos"] = ((q_ND * neg_MD[pos_idx_N]).sum(-1).sum(), num_rows)
    return loss_N.sum(), num_rows, metrics


def _with_hard_negatives(q_ND, k_MD, neg_MD, pos_idx_N, *, temperature: float, margin: float, self_idx_N,
                         weight: float, dtype, impl: str, chunk_size: int, check_values: bool = True) -> torch.Tensor:
    """loss_N over the 2M columns [k; neg] (normalised inputs). With weight 1 the plain InfoNCE over them; else row
    i's own hard negative is left out of the fused softmax and added back as log(weight) + h_i,own."""
    if neg_MD.shape != k_MD.shape:
        raise ValueError(f"info_nce: hard negatives {tuple(neg_MD.shape)} must match the keys {tuple(k_MD.shape)} "
                         "(one hard negative per pair)")
    keys = torch.cat([k_MD, neg_MD]).to(dtype)
    if weight == 1.0:
        return info_nce_rows(q_ND.to(dtype), keys, pos_idx_N, temperature=temperature, margin=margin,
                             self_idx_N=self_idx_N, impl=impl, chunk_size=chunk_size, check_values=check_values)
    if weight < 0:
        raise ValueError(f"info_nce: the hard-negative weight must be >= 0, got {weight}")
    if self_idx_N is not None:
        raise ValueError("info_nce: a hard-negative weight other than 1 cannot be combined with self_idx_N")
    own_N = pos_idx_N.to(q_ND.device, torch.long) + k_MD.shape[0]
    loss_N, lse_N = info_nce_rows(q_ND.to(dtype), keys, pos_idx_N, temperature=temperature, margin=margin,
                                  self_idx_N=own_N, impl=impl, chunk_size=chunk_size, return_lse=True,
                                  check_values=check_values)
    if weight == 0.0:
        return loss_N
    h_own_N = (q_ND * neg_MD[pos_idx_N]).sum(-1).to(lse_N.dtype) / temperature
    return loss_N - lse_N + torch.logaddexp(lse_N, h_own_N + math.log(weight))


def _wide(x: torch.Tensor) -> torch.Tensor:
    """float64 stays, everything else (bf16/fp16/fp32) is handled in float32."""
    return x if x.dtype == torch.float64 else x.float()
