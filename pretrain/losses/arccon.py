"""ArcCon (ArcCSE eq. 3): InfoNCE whose positive logit carries an additive angular margin.

Shape legend: N = local queries, M = keys (gathered view 2), D = embedding dim.

The positive logit is cos(theta + m) / tau with theta = arccos(q . k_pos); negatives keep
cos(theta_ij) / tau. The margin itself is ``pretrain.ops.arc_margin`` (one definition for the
whole code base): the exact value, with a gradient bounded near theta = 0 and pi.
"""

from __future__ import annotations

import math

import torch

from pretrain.losses.info_nce import Metrics, info_nce


def arccon(
    q_ND: torch.Tensor,
    k_MD: torch.Tensor,
    pos_idx_N: torch.Tensor,
    *,
    temperature: float = 0.05,
    margin_deg: float = 10.0,
    self_idx_N: torch.Tensor | None = None,
    impl: str = "eager",
    chunk_size: int = 1024,
    neg_MD: torch.Tensor | None = None,
    neg_weight: float = 1.0,
    check_values: bool = True,
) -> tuple[torch.Tensor, int, Metrics]:
    """ArcCon loss -> (loss_sum, N, metrics); margin in degrees (paper: 10); margin_deg = 0 is exactly info_nce.
    ``neg_MD``/``neg_weight``: hard negatives as extra columns, as in ``info_nce``."""
    if not 0.0 <= margin_deg < 90.0:
        raise ValueError(f"ArcCon margin must be in [0, 90) degrees, got {margin_deg}")
    return info_nce(
        q_ND, k_MD, pos_idx_N, temperature=temperature, margin=math.radians(margin_deg),
        self_idx_N=self_idx_N, impl=impl, chunk_size=chunk_size, neg_MD=neg_MD, neg_weight=neg_weight,
        check_values=check_values,
    )
