"""`torch.library` custom ops for the masked log-sum-exp: schema, fake kernels and autograd.

`pretrain_ops::masked_lse(q, k, excl, inv_temp, chunk_size) -> lse_N` and its backward are opaque to
torch.compile (fake kernels give the shapes). On CUDA tensors they run the fused kernels of csrc/
when the extension is loaded; everywhere else (and as a fallback) the chunked torch implementation.
Legend: N rows, M columns, D embedding size, E exclusions per row.
"""

from __future__ import annotations

import torch

from pretrain.ops import chunked, extension


@torch.library.custom_op("pretrain_ops::masked_lse", mutates_args=())
def masked_lse(
    q: torch.Tensor, k: torch.Tensor, excl: torch.Tensor, inv_temp: float, chunk_size: int
) -> torch.Tensor:
    """lse_N over the non-excluded columns (fp32); chunked torch implementation (any device)."""
    return chunked.masked_lse_forward(q, k, excl, inv_temp, chunk_size)


@torch.library.custom_op("pretrain_ops::masked_lse_backward", mutates_args=())
def masked_lse_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    excl: torch.Tensor,
    inv_temp: float,
    lse: torch.Tensor,
    grad: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dq_ND, dk_MD) for d(sum_i grad_i * lse_i); chunked torch implementation (any device)."""
    return chunked.masked_lse_backward(q, k, excl, inv_temp, lse, grad, chunk_size)


@masked_lse.register_kernel("cuda")
def _masked_lse_cuda(q, k, excl, inv_temp, chunk_size):
    if extension.cuda_available():
        return torch.ops.pretrain_cuda.masked_lse_fwd(q, k, excl, inv_temp)
    return chunked.masked_lse_forward(q, k, excl, inv_temp, chunk_size)


@masked_lse_backward.register_kernel("cuda")
def _masked_lse_backward_cuda(q, k, excl, inv_temp, lse, grad, chunk_size):
    if extension.cuda_available():
        return tuple(torch.ops.pretrain_cuda.masked_lse_bwd(q, k, excl, inv_temp, lse, grad))
    return chunked.masked_lse_backward(q, k, excl, inv_temp, lse, grad, chunk_size)


@masked_lse.register_fake
def _masked_lse_fake(q, k, excl, inv_temp, chunk_size):
    return q.new_empty((q.shape[0],), dtype=chunked.acc_dtype(q.dtype))


@masked_lse_backward.register_fake
def _masked_lse_backward_fake(q, k, excl, inv_temp, lse, grad, chunk_size):
    return torch.empty_like(q), torch.empty_like(k)


def _setup_context(ctx, inputs, output):
    q, k, excl, inv_temp, chunk_size = inputs
    ctx.save_for_backward(q, k, excl, output)
    ctx.inv_temp, ctx.chunk_size = inv_temp, chunk_size


def _backward(ctx, grad_N):
    q, k, excl, lse_N = ctx.saved_tensors
    dq, dk = masked_lse_backward(q, k, excl, ctx.inv_temp, lse_N, grad_N.contiguous(), ctx.chunk_size)
    return dq, dk, None, None, None


masked_lse.register_autograd(_backward, setup_context=_setup_context)
