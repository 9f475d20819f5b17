"""RankCSE ranking losses: JS ranking consistency, ListNet and ListMLE distillation.

Shape legend: N = local sentences (rows), M = list length (all ranks' sentences, gathered
by the caller), D = embedding dim, M1 = M - 1 (the list without the positive).

Row i of a similarity matrix is the list S(x_i) = {cos(f(x_i), f(x_j)')}_j of RankCSE; the
student lists of both dropout views and the teacher lists must share one column order.
Each loss is a sum over rows, returned with the row count (RankCSE eqs. 2, 4, 5).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F

from pretrain.losses.info_nce import Metrics


def cosine_matrix(a_ND: torch.Tensor, b_MD: torch.Tensor) -> torch.Tensor:
    """cos(a_i, b_j) as an N x M matrix, float32 (float64 stays float64)."""
    a_ND, b_MD = (x if x.dtype == torch.float64 else x.float() for x in (a_ND, b_MD))
    return F.normalize(a_ND, dim=-1) @ F.normalize(b_MD, dim=-1).T


def mix_teacher_sims(sims: Sequence[torch.Tensor], weights: Sequence[float]) -> torch.Tensor:
    """Pseudo ranking labels S_T = sum_k w_k S_Tk (RankCSE: alpha S_T1 + (1 - alpha) S_T2)."""
    if len(sims) == 0 or len(sims) != len(weights):
        raise ValueError(f"need one weight per teacher similarity matrix, got {len(sims)} and {len(weights)}")
    if abs(sum(weights) - 1.0) > 1e-6:
        raise ValueError(f"teacher weights must sum to 1, got {list(weights)}")
    out = weights[0] * sims[0]
    for w, s in zip(weights[1:], sims[1:]):
        out = out + w * s
    return out


def drop_positive(x_NM: torch.Tensor, pos_idx_N: torch.Tensor) -> torch.Tensor:
    """Remove column pos_idx_N[i] from row i: N x M -> N x (M - 1), order of the rest kept. A gather of the kept
    columns (column j of the result is j, or j + 1 from the positive on), not a boolean mask, whose index the host
    would have to read (a sync on a GPU, forward and backward)."""
    num_cols = x_NM.shape[1]
    cols_M = torch.arange(num_cols - 1, device=x_NM.device)
    cols_NM = cols_M + (cols_M >= pos_idx_N.to(x_NM.device)[:, None]).to(cols_M.dtype)
    return x_NM.gather(1, cols_NM)


def js_consistency(
    sim_a_NM: torch.Tensor, sim_b_NM: torch.Tensor, *, temperature: float = 0.05
) -> tuple[torch.Tensor, int, Metrics]:
    """sum_i JS(softmax(a_i / tau1) || softmax(b_i / tau1)) -> (loss_sum, N, metrics).

    a = cos(view1_i, view2_j), b = cos(view2_i, view1_j); JS uses natural log (max ln 2).
    """
    _check_temperature(temperature)
    logp_NM = F.log_softmax(_wide(sim_a_NM) / temperature, dim=-1)
    logq_NM = F.log_softmax(_wide(sim_b_NM) / temperature, dim=-1)
    logm_NM = torch.logaddexp(logp_NM, logq_NM) - math.log(2.0)
    kl_pm_N = (logp_NM.exp() * (logp_NM - logm_NM)).sum(-1)
    kl_qm_N = (logq_NM.exp() * (logq_NM - logm_NM)).sum(-1)
    js_N = 0.5 * (kl_pm_N + kl_qm_N)
    num_rows = js_N.shape[0]
    return js_N.sum(), num_rows, {"js": (js_N.detach().sum(), num_rows)}


def listnet(
    student_NM: torch.Tensor,
    teacher_NM: torch.Tensor,
    *,
    student_temperature: float = 0.025,
    teacher_temperature: float = 0.0125,
    pos_idx_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int, Metrics]:
    """Top-one ListNet: -sum_i softmax(T_i / tau3) . log softmax(S_i / tau2) -> (loss_sum, N, metrics).

    With pos_idx_N, the positive column is removed from both lists first (RankCSE footnote 1).
    The teacher side carries no gradient.
    """
    _check_temperature(student_temperature)
    _check_temperature(teacher_temperature)
    student_NM, teacher_NM = _prepare(student_NM, teacher_NM, pos_idx_N)
    target_NM = F.softmax(teacher_NM / teacher_temperature, dim=-1)
    logp_NM = F.log_softmax(student_NM / student_temperature, dim=-1)
    loss_N = -(target_NM * logp_NM).sum(-1)
    num_rows = loss_N.shape[0]
    with torch.no_grad():
        entropy_N = -(target_NM * torch.log(target_NM.clamp_min(1e-30))).sum(-1)
        # An empty list (one column, the positive, dropped: one sentence per rank without gathering) has no top one.
        top1_N = ((student_NM.argmax(-1) == teacher_NM.argmax(-1)).to(loss_N.dtype) if student_NM.shape[1]
                  else torch.zeros_like(loss_N))
    return loss_N.sum(), num_rows, {
        "kl": ((loss_N.detach() - entropy_N).sum(), num_rows),
        "top1_agree": (top1_N.sum(), num_rows),
    }


def listmle(
    student_NM: torch.Tensor,
    teacher_NM: torch.Tensor,
    *,
    temperature: float = 0.05,
    pos_idx_N: torch.Tensor | None = None,
) -> tuple[torch.Tensor, int, Metrics]:
    """ListMLE: -sum_i log P(pi_i^T | S_i / tau2), pi^T the teacher's descending order -> (loss_sum, N, metrics).

    P(pi | s) = prod_k exp(s_pi(k)) / sum_{j >= k} exp(s_pi(j)) (Plackett-Luce).
    With pos_idx_N, the positive column is removed from both lists first.
    """
    _check_temperature(temperature)
    student_NM, teacher_NM = _prepare(student_NM, teacher_NM, pos_idx_N)
    order_NM = torch.argsort(teacher_NM, dim=-1, descending=True, stable=True)
    s_NM = student_NM.gather(1, order_NM) / temperature
    # logsumexp over the suffix s_pi(k..M): reverse, cumulative logsumexp, reverse back.
    suffix_lse_NM = torch.logcumsumexp(s_NM.flip(-1), dim=-1).flip(-1)
    loss_N = (suffix_lse_NM - s_NM).sum(-1)
    num_rows = loss_N.shape[0]
    return loss_N.sum(), num_rows, {"nll_per_item": (loss_N.detach().sum() / max(s_NM.shape[1], 1), num_rows)}


def _prepare(student_NM, teacher_NM, pos_idx_N):
    if student_NM.shape != teacher_NM.shape:
        raise ValueError(f"student and teacher lists differ in shape: {tuple(student_NM.shape)} "
                         f"vs {tuple(teacher_NM.shape)}; the teacher must score the same sentences")
    student_NM, teacher_NM = _wide(student_NM), _wide(teacher_NM).detach()
    if pos_idx_N is not None:
        student_NM, teacher_NM = drop_positive(student_NM, pos_idx_N), drop_positive(teacher_NM, pos_idx_N)
    return student_NM, teacher_NM


def _wide(x: torch.Tensor) -> torch.Tensor:
    return x if x.dtype == torch.float64 else x.float()


def _check_temperature(t: float) -> None:
    if not t > 0:
        raise ValueError(f"ranking temperature must be > 0, got {t}")
