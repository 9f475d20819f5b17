"""Masked language modelling loss over the masked positions only.

Legend: M = number of masked positions in the batch, V = vocabulary size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def mlm_loss(logits_MV: torch.Tensor, labels_M: torch.Tensor):
    """Cross-entropy summed over masked positions -> (loss_sum, count, metrics).

    metrics: {"mlm_acc": (correct, M)}; the caller divides by the count summed over ranks. A position is correct
    when its label's logit is the row's largest (a tie for the largest counts as correct): the label's logit
    against the row's ``amax``, a vectorised reduction, where ``argmax`` is a scalar loop on the CPU (2-core AMD
    EPYC, 614 x 30,522 fp32 logits: 2.3 against 13.9 ms, about 1% of a mini model's step).
    """
    count = labels_M.numel()
    if count == 0:
        zero = logits_MV.sum() * 0.0  # keeps the graph (and DeepSpeed's hooks) intact
        return zero, 0, {"mlm_acc": (0.0, 0)}
    loss_sum = F.cross_entropy(logits_MV.float(), labels_M, reduction="sum")
    with torch.no_grad():
        # a tensor: no host sync mid-forward
        # (unlabelled rows, -100, as train.compile_shapes=bucketed pads with, are never correct)
        top_M = logits_MV.gather(1, labels_M.clamp(min=0)[:, None]).squeeze(1) >= logits_MV.amax(dim=-1)
        correct = (top_M & (labels_M >= 0)).sum()
    return loss_sum, count, {"mlm_acc": (correct, count)}
