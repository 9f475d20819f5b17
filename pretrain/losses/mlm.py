"""Masked language modelling loss over the masked positions only.

Legend: M = number of masked positions in the batch, V = vocabulary size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mlm_loss(logits_MV: torch.Tensor, labels_M: torch.Tensor):
    """Cross-entropy summed over masked positions -> (loss_sum, count, metrics).

    metrics: {"mlm_acc": (correct, M)}; the caller divides by the count summed over ranks.
    """
    count = labels_M.numel()
    if count == 0:
        zero = logits_MV.sum() * 0.0  # keeps the graph (and DeepSpeed's hooks) intact
        return zero, 0, {"mlm_acc": (0.0, 0)}
    loss_sum = F.cross_entropy(logits_MV.float(), labels_M, reduction="sum")
    with torch.no_grad():
        correct = (logits_MV.argmax(dim=-1) == labels_M).sum()  # a tensor: no host sync mid-forward
    return loss_sum, count, {"mlm_acc": (correct, count)}
