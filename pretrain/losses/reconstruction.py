"""SARCSE self-adaptive reconstruction loss and its token-frequency weights.

Shape legend: B = sentences, T = content tokens ([CLS]/[SEP] removed), D = hidden size,
V = vocabulary size.

L_R = (1/N) sum_i f(w_i) * MSE(x_i, x'_i) per sentence of N tokens, with
f(w) = max(theta, 1 - lam * freq(w)) and freq the normalised token frequency of the
training set (SARCSE eqs. 8-10); MSE averages over the D features. The same function gives
L_R+ when fed the second dropout view.
"""

from __future__ import annotations

import torch

from pretrain.losses.info_nce import Metrics


def frequency_weights(
    token_ids_BT: torch.Tensor, freq_V: torch.Tensor, theta: float = 0.1, lam: float = 50.0
) -> torch.Tensor:
    """f(w) = max(theta, 1 - lam * freq(w)) per token -> w_BT in freq_V's dtype (no gradient)."""
    freq_V = freq_V.to(token_ids_BT.device)
    return torch.clamp(1.0 - lam * freq_V[token_ids_BT], min=theta)


def reconstruction_loss(
    x_BTD: torch.Tensor,
    recon_BTD: torch.Tensor,
    weight_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    *,
    detach_target: bool = False,
    host_count: bool = True,
) -> tuple[torch.Tensor, int | torch.Tensor, Metrics]:
    """sum_b (1/N_b) sum_i w_bi * mean_d (x - x')^2 over sentences with N_b > 0 -> (loss_sum, count, metrics).
    The count (sentences with N_b > 0) is an int read on the host, or with ``host_count`` false a device tensor
    (the trainer's step, whose host knows it: no sync); the metrics' counts are device tensors."""
    if x_BTD.shape != recon_BTD.shape or x_BTD.shape[:2] != weight_BT.shape or weight_BT.shape != mask_BT.shape:
        raise ValueError(
            f"reconstruction shapes disagree: x {tuple(x_BTD.shape)}, recon {tuple(recon_BTD.shape)}, "
            f"weight {tuple(weight_BT.shape)}, mask {tuple(mask_BT.shape)}"
        )
    x_BTD = x_BTD.detach() if detach_target else x_BTD
    dtype = torch.float64 if x_BTD.dtype == torch.float64 else torch.float32
    mask_BT = mask_BT.to(dtype)
    mse_BT = (recon_BTD.to(dtype) - x_BTD.to(dtype)).pow(2).mean(-1)
    num_tokens_B = mask_BT.sum(-1)
    has_tokens_B = num_tokens_B > 0
    per_sentence_B = (weight_BT.to(dtype) * mse_BT * mask_BT).sum(-1) / num_tokens_B.clamp_min(1.0)
    count = has_tokens_B.sum()
    with torch.no_grad():
        metrics: Metrics = {"mse": ((mse_BT * mask_BT).sum(), num_tokens_B.sum())}
    if host_count:
        count = int(count)
    return (per_sentence_B * has_tokens_B).sum(), count, metrics
