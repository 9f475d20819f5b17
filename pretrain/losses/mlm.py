"""Masked language modelling loss over the masked positions only.

Legend: M = number of masked positions in the batch, V = vocabulary size.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pretrain.model.kernels import KINDS, cpu_kernels


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
    if _fused(logits_MV, labels_M):
        loss_sum, correct = _FusedCrossEntropy.apply(logits_MV, labels_M)
        return loss_sum, count, {"mlm_acc": (correct, count)}
    x_MV = logits_MV.float()  # bf16 logits cast once, for the loss and the accuracy (an fp32 amax is the cheaper)
    if logits_MV.device.type == "cpu" and not torch.compiler.is_compiling():
        loss_sum = _SummedCrossEntropy.apply(x_MV, labels_M)
    else:
        loss_sum = F.cross_entropy(x_MV, labels_M, reduction="sum")
    with torch.no_grad():
        # a tensor: no host sync mid-forward
        # (unlabelled rows, -100, as train.compile_shapes=bucketed pads with, are never correct)
        top_M = x_MV.gather(1, labels_M.clamp(min=0)[:, None]).squeeze(1) >= x_MV.amax(dim=-1)
        correct = (top_M & (labels_M >= 0)).sum()
    return loss_sum, count, {"mlm_acc": (correct, count)}


class _SummedCrossEntropy(torch.autograd.Function):
    """``F.cross_entropy(x_MV, labels_M, reduction="sum")`` (labels -100 ignored) for the CPU: the forward's
    log-softmax is kept and turned into the gradient in place, exp(log p) * g with g subtracted at each label: two
    passes over the (M, V) block where torch's backward fills a zero gradient, scatters into it and runs the
    log-softmax backward over it (an fp32 mini step's 469 x 30,522 logits: 24 -> 18 ms forward + backward, a
    ModernBERT mini step's 1%; docs/performance.md). Checked against float64 in tests/unit/test_losses_seed.py."""

    @staticmethod
    def forward(ctx, x_MV: torch.Tensor, labels_M: torch.Tensor) -> torch.Tensor:
        logp_MV = torch.log_softmax(x_MV, dim=-1)
        valid_M = labels_M >= 0
        label_M1 = labels_M.clamp(min=0)[:, None]
        picked_M = logp_MV.gather(1, label_M1).squeeze(1)
        ctx.save_for_backward(logp_MV, label_M1, valid_M)
        return torch.where(valid_M, -picked_M, 0.0).sum()  # where, not a product: an unlabelled NaN row is ignored

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        logp_MV, label_M1, valid_M = ctx.saved_tensors
        coef_M1 = torch.where(valid_M, g, 0.0).to(logp_MV.dtype)[:, None]
        grad_MV = logp_MV.exp_().mul_(coef_M1)  # the saved log-softmax is read by nothing else
        return grad_MV.scatter_add_(1, label_M1, -coef_M1), None


def _fused(logits_MV: torch.Tensor, labels_M: torch.Tensor) -> bool:
    """Whether the C kernel computes the loss (``_FusedCrossEntropy``): built, the CPU, eager, 2-D fp32/bf16 logits
    and a label per row (the kernel reads a label for every row: other counts go to torch's path, which refuses
    them)."""
    return (not torch.compiler.is_compiling() and logits_MV.device.type == "cpu" and cpu_kernels() is not None
            and logits_MV.dim() == 2 and logits_MV.dtype in KINDS and logits_MV.numel() > 0 and labels_M.dim() == 1
            and labels_M.shape[0] == logits_MV.shape[0] and labels_M.device.type == "cpu")


class _FusedCrossEntropy(torch.autograd.Function):
    """(loss summed over the labelled rows, their count of top-1 hits) by the C kernel (csrc/cpu/model_kernels.c):
    per row one pass for the max and one for the sum of exponentials (the row in cache), nothing of the (M, V)
    block written; the backward one pass from the logits and the rows' log-sum-exp, in the logits' dtype (bf16
    logits are read as they are: no fp32 copy either way). A labelled row with a NaN or +inf logit has a NaN loss,
    an unlabelled one (-100) is ignored, as ``F.cross_entropy``; a hit is the label's logit reaching the row's
    max, as ``mlm_loss``'s amax rule. Saves the logits (the decoder's output, which its backward does not keep)
    and M floats."""

    @staticmethod
    def forward(ctx, logits_MV: torch.Tensor, labels_M: torch.Tensor):
        x_MV, labels_M = logits_MV.contiguous(), labels_M.to(torch.int64).contiguous()
        m, v = x_MV.shape
        lse_M, loss_M = x_MV.new_empty(m, dtype=torch.float32), x_MV.new_empty(m, dtype=torch.float32)
        correct_M = x_MV.new_empty(m, dtype=torch.uint8)
        beyond = cpu_kernels().cross_entropy(x_MV.data_ptr(), m, v, KINDS[x_MV.dtype], labels_M.data_ptr(),
                                             lse_M.data_ptr(), loss_M.data_ptr(), correct_M.data_ptr(),
                                             torch.get_num_threads())
        if beyond:
            raise ValueError(f"mlm_loss: {beyond} MLM label(s) >= the vocabulary size {v}: the data was tokenized with "
                             "another vocabulary than model.vocab_size; re-preprocess it with the model's tokenizer")
        ctx.save_for_backward(x_MV, labels_M, lse_M)
        correct = correct_M.sum()
        ctx.mark_non_differentiable(correct)
        return loss_M.sum(), correct

    @staticmethod
    def backward(ctx, g: torch.Tensor, _):
        x_MV, labels_M, lse_M = ctx.saved_tensors
        grad_MV = torch.empty_like(x_MV)
        coef = float(g.detach().float().numpy())  # the CPU: read without .item() (no op a device would sync on)
        cpu_kernels().cross_entropy_grad(x_MV.data_ptr(), x_MV.shape[0], x_MV.shape[1], KINDS[x_MV.dtype],
                                         labels_M.data_ptr(), lse_M.data_ptr(), coef, grad_MV.data_ptr(),
                                         torch.get_num_threads())
        return grad_MV, None
