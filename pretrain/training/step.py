"""What every training step does beside the model: its dropout seed, its token count, the move to the device and
the all-ranks finite check."""

from __future__ import annotations

import contextlib

import torch

from pretrain.distributed.comm import all_reduce_host


@contextlib.contextmanager
def dropout_rng(seed: int, step: int, rank: int, device):
    """Dropout (and any other RNG use inside) keyed by (seed, step, rank), scoped: the process-global RNG
    state (CPU, and the device's on CUDA) is restored on exit."""
    on_cuda = torch.device(device).type == "cuda"
    devices = [torch.device(device).index or 0] if on_cuda else []
    with torch.random.fork_rng(devices=devices):
        torch.manual_seed((seed * 1_000_003 + step * 1009 + rank) % (2**63))
        yield


def count_tokens(batch: dict) -> int:
    """Real (non-padding) tokens of a batch: the sequence and both views."""
    return int(sum(batch[k].sum() for k in ("attention_mask", "view_a_mask", "view_b_mask") if k in batch))


def to_device(batch: dict, device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def all_finite(loss: torch.Tensor, env) -> bool:
    ok = torch.tensor([1 if bool(torch.isfinite(loss.detach()).all()) else 0])
    if env.is_distributed:
        ok = all_reduce_host(ok, torch.distributed.ReduceOp.MIN)
    return bool(ok.item())


