"""Chunked pure-torch masked log-sum-exp over a similarity matrix that is never materialised.

The primitive every in-batch contrastive loss here reduces to is

    lse_N[i] = log sum_{j not in excl_NE[i]} exp(q_i . k_j * inv_temp)

(excluded columns: the positive, handled separately by the caller, and the self column).
Columns are streamed in chunks of `chunk_size`, so memory is O(N*d + N*chunk) instead of O(N*M);
the backward pass recomputes each chunk. Everything is accumulated in fp32 (half inputs are
upcast once, O(N*d)). The CUDA kernels in csrc/ compute exactly the same two functions.

Legend: N rows (queries), M columns (keys), D embedding size, C column chunk, E exclusions per row
(entries < 0 mean "none").
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype: float64 stays float64 (for references), everything else is fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _mask_excluded_(s_NC: torch.Tensor, excl_NE: torch.Tensor, col0: int) -> None:
    """Set s[i, excl[i, e] - col0] = -inf in place where that column lies in this chunk.

    Gather/where/scatter instead of boolean indexing: no host sync, traceable by torch.compile.
    """
    num_cols = s_NC.shape[1]
    for e in range(excl_NE.shape[1]):
        local_N1 = excl_NE[:, e : e + 1] - col0
        inside_N1 = (local_N1 >= 0) & (local_N1 < num_cols)
        local_N1 = local_N1.clamp(0, num_cols - 1)
        kept_N1 = s_NC.gather(1, local_N1)
        s_NC.scatter_(1, local_N1, torch.where(inside_N1, torch.full_like(kept_N1, NEG_INF), kept_N1))


def _scores(q_ND: torch.Tensor, k_CD: torch.Tensor, excl_NE: torch.Tensor, col0: int, inv_temp: float):
    """fp32 scaled similarities of all rows against one column chunk, exclusions set to -inf."""
    s_NC = torch.mm(q_ND, k_CD.t())
    s_NC.mul_(inv_temp)
    _mask_excluded_(s_NC, excl_NE, col0)
    return s_NC


def masked_lse_forward(
    q_ND: torch.Tensor, k_MD: torch.Tensor, excl_NE: torch.Tensor, inv_temp: float, chunk_size: int
) -> torch.Tensor:
    """lse_N (fp32; float64 for float64 inputs) over non-excluded columns; -inf for a row whose columns are all excluded."""
    acc = acc_dtype(q_ND.dtype)
    q32_ND, k32_MD = q_ND.to(acc), k_MD.to(acc)
    lse_N = torch.full((q_ND.shape[0],), NEG_INF, dtype=acc, device=q_ND.device)
    for col0 in range(0, k_MD.shape[0], chunk_size):
        s_NC = _scores(q32_ND, k32_MD[col0 : col0 + chunk_size], excl_NE, col0, inv_temp)
        max_N = s_NC.amax(dim=1)
        safe_max_N = torch.where(torch.isinf(max_N), torch.zeros_like(max_N), max_N)
        s_NC.sub_(safe_max_N[:, None]).exp_()
        chunk_lse_N = safe_max_N + s_NC.sum(dim=1).log()
        lse_N = torch.logaddexp(lse_N, chunk_lse_N)
    return lse_N


def masked_lse_backward(
    q_ND: torch.Tensor,
    k_MD: torch.Tensor,
    excl_NE: torch.Tensor,
    inv_temp: float,
    lse_N: torch.Tensor,
    grad_N: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq_ND, dk_MD) in the inputs' dtypes for d(sum_i grad_i * lse_i)."""
    acc = acc_dtype(q_ND.dtype)
    q32_ND, k32_MD = q_ND.to(acc), k_MD.to(acc)
    lse_N = lse_N.to(acc)
    # A row with no live column (lse = -inf) has no gradient; 0 keeps exp(-inf - 0) = 0 finite.
    dead_N = torch.isinf(lse_N)
    safe_lse_N = torch.where(dead_N, torch.zeros_like(lse_N), lse_N)
    coef_N = torch.where(dead_N, torch.zeros_like(grad_N), grad_N.to(acc) * inv_temp)
    dq_ND = torch.zeros_like(q32_ND)
    dk_MD = torch.empty_like(k32_MD)
    for col0 in range(0, k_MD.shape[0], chunk_size):
        k_CD = k32_MD[col0 : col0 + chunk_size]
        p_NC = _scores(q32_ND, k_CD, excl_NE, col0, inv_temp)
        # p = softmax entry * grad / T: the derivative of grad*lse w.r.t. the raw dot product.
        p_NC.sub_(safe_lse_N[:, None]).exp_().mul_(coef_N[:, None])
        dq_ND.addmm_(p_NC, k_CD)
        torch.mm(p_NC.t(), q32_ND, out=dk_MD[col0 : col0 + chunk_size])
    return dq_ND.to(q_ND.dtype), dk_MD.to(k_MD.dtype)


class ChunkedMaskedLSE(torch.autograd.Function):
    """Autograd wrapper of the chunked torch path: differentiable w.r.t. q and k."""

    @staticmethod
    def forward(ctx, q_ND, k_MD, excl_NE, inv_temp: float, chunk_size: int):
        lse_N = masked_lse_forward(q_ND, k_MD, excl_NE, inv_temp, chunk_size)
        ctx.save_for_backward(q_ND, k_MD, excl_NE, lse_N)
        ctx.inv_temp, ctx.chunk_size = inv_temp, chunk_size
        return lse_N

    @staticmethod
    def backward(ctx, grad_N):
        q_ND, k_MD, excl_NE, lse_N = ctx.saved_tensors
        dq_ND, dk_MD = masked_lse_backward(q_ND, k_MD, excl_NE, ctx.inv_temp, lse_N, grad_N, ctx.chunk_size)
        return (
            dq_ND if ctx.needs_input_grad[0] else None,
            dk_MD if ctx.needs_input_grad[1] else None,
            None,
            None,
            None,
        )
