"""ArcCSE triplet entailment loss and the dropout-off context it is encoded under.

Shape legend: N = sentences with a triplet (>= min_words words), D = embedding dim.

For the anchor s and its masked views s' (~20% words masked) and s'' (~40%, a superset of
the s' mask), all encoded with dropout off, the loss is
max(0, cos(h, h'') - cos(h, h') + m): s' must stay closer to s than s'' (ArcCSE eq. 4, m = 0).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.losses.info_nce import Metrics


def triplet_entailment(
    h_ND: torch.Tensor,
    h1_ND: torch.Tensor,
    h2_ND: torch.Tensor,
    *,
    margin: float = 0.0,
) -> tuple[torch.Tensor, int, Metrics]:
    """sum_i max(0, cos(h_i, h2_i) - cos(h_i, h1_i) + margin) -> (loss_sum, N, metrics).

    h1 is the lightly masked view (s'), h2 the heavily masked one (s''). N may be 0.
    """
    if not (h_ND.shape == h1_ND.shape == h2_ND.shape):
        raise ValueError(f"triplet views must share a shape, got {tuple(h_ND.shape)}, "
                         f"{tuple(h1_ND.shape)}, {tuple(h2_ND.shape)}")
    h_ND, h1_ND, h2_ND = (x if x.dtype == torch.float64 else x.float() for x in (h_ND, h1_ND, h2_ND))
    sim1_N = F.cosine_similarity(h_ND, h1_ND, dim=-1)
    sim2_N = F.cosine_similarity(h_ND, h2_ND, dim=-1)
    loss_N = torch.relu(sim2_N - sim1_N + margin)
    num_rows = h_ND.shape[0]
    with torch.no_grad():
        metrics: Metrics = {
            "order_acc": ((sim1_N > sim2_N).to(sim1_N.dtype).sum(), num_rows),
            "sim_gap": ((sim1_N - sim2_N).sum(), num_rows),
        }
    return loss_N.sum(), num_rows, metrics


@contextlib.contextmanager
def dropout_off(module: nn.Module) -> Iterator[nn.Module]:
    """Put every submodule in eval mode (dropout, attention dropout) and restore each flag after.

    Gradients still flow: ArcCSE trains through the dropout-free triplet encodings.
    """
    flags = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield module
    finally:
        for m, was_training in flags:
            m.training = was_training
