"""Collectives that the losses need: all-gather with gradient and a summing all-reduce.

`all_gather_with_grad` concatenates every rank's (N, D) block in rank order. Its backward is a
reduce-scatter (sum) of the incoming gradient, so when each rank's loss uses the gathered columns
and the losses are summed over ranks, every rank's local gradient equals the single-process one.
`env` is a DistEnv (rank, world_size); the default torch.distributed group is used.
Legend: N rows per rank, W world size, D embedding size.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gather(x_ND: torch.Tensor, world_size: int) -> torch.Tensor:
    out_WND = torch.empty((world_size * x_ND.shape[0], *x_ND.shape[1:]), dtype=x_ND.dtype, device=x_ND.device)
    dist.all_gather_into_tensor(out_WND, x_ND.contiguous())
    return out_WND


def _reduce_scatter_sum(g_WND: torch.Tensor, rank: int, world_size: int) -> torch.Tensor:
    g_WND = g_WND.contiguous()
    rows = g_WND.shape[0] // world_size
    if dist.get_backend() == "nccl":
        out_ND = torch.empty((rows, *g_WND.shape[1:]), dtype=g_WND.dtype, device=g_WND.device)
        dist.reduce_scatter_tensor(out_ND, g_WND, op=dist.ReduceOp.SUM)
        return out_ND
    # gloo has no reduce_scatter: all-reduce the whole gradient and keep this rank's block.
    total_WND = g_WND.clone()
    dist.all_reduce(total_WND, op=dist.ReduceOp.SUM)
    return total_WND[rank * rows : (rank + 1) * rows].clone()


class _AllGatherWithGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x_ND, rank: int, world_size: int):
        ctx.rank, ctx.world_size = rank, world_size
        return _gather(x_ND, world_size)

    @staticmethod
    def backward(ctx, g_WND):
        return _reduce_scatter_sum(g_WND, ctx.rank, ctx.world_size), None, None


def all_gather_with_grad(x_ND: torch.Tensor, env) -> torch.Tensor:
    """(W*N, D) concatenation of all ranks' x in rank order, differentiable (backward = reduce-scatter sum).

    Every rank must pass the same shape. With one process it returns x itself.
    """
    if env is None or env.world_size == 1:
        return x_ND
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("all_gather_with_grad needs an initialised torch.distributed process group "
                         "(call pretrain.distributed.env.init_process_group first)")
    return _AllGatherWithGrad.apply(x_ND, env.rank, env.world_size)


def all_reduce_host(t: torch.Tensor, op=None) -> torch.Tensor:
    """All-reduce a small host (CPU) tensor of flags or counts and return it on the CPU.

    NCCL only reduces CUDA tensors, so under NCCL the values travel through the current CUDA device;
    gloo reduces them in place on the CPU. Call only with an initialised process group.
    """
    op = dist.ReduceOp.SUM if op is None else op
    if dist.get_backend() == "nccl":
        dev = t.to(torch.device("cuda", torch.cuda.current_device()))
        dist.all_reduce(dev, op=op)
        return dev.cpu()
    dist.all_reduce(t, op=op)
    return t


def all_reduce_sum(t: torch.Tensor, env) -> torch.Tensor:
    """A new tensor holding the sum of `t` over all ranks (no gradient); `t` itself with one process."""
    if env is None or env.world_size == 1:
        return t
    out = t.detach().clone()
    dist.all_reduce(out, op=dist.ReduceOp.SUM)
    return out
