"""One optimizer step as the trainer runs it (``optimizer_step``: forward -> loss -> backward -> step -> metrics
over grad_accum micro-batches), and what it needs beside the model: the dropout seed, the token count, the move to
the device and the all-ranks finite check. ``tools/bench_step.py`` times this same function."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from pretrain.distributed.comm import all_reduce_host


@dataclass
class StepResult:
    info: object
    """The Engine's StepInfo (lr, grad norm, loss scale, skipped)."""
    bad: bool
    """A non-finite loss or gradient skipped the update (fp16 loss-scale overflows are routine, not bad)."""
    samples: int
    tokens: int
    """This rank's samples and real (non-padding) tokens."""


def optimizer_step(engine, next_batch, sums, *, env, grad_accum: int, seed: int, step: int,
                   precision: str) -> StepResult:
    """grad_accum micro-batches from ``next_batch()`` through forward -> loss -> backward, then the update (or its
    skip when any rank saw a non-finite loss or gradient); finite micro-batches' metrics are added to ``sums``."""
    loss_ok, n_samples, n_tokens = True, 0, 0
    # Dropout noise is a function of (seed, step, rank): exact resume needs no RNG replay.
    with dropout_rng(seed, step, env.rank, engine.device):
        for _ in range(grad_accum):
            batch = next_batch()  # counted on the host, then moved: no device sync
            n_samples += batch["input_ids"].shape[0]
            n_tokens += count_tokens(batch)
            loss, metrics = engine.forward(to_device(batch, engine.device))
            finite = all_finite(loss, env)  # all ranks agree: a bad micro-batch anywhere skips the step
            if finite:
                sums.update(metrics)
                sums.add("loss", loss.detach().item(), 1)  # x world size: the rank mean is the global loss
            loss_ok &= finite
            engine.micro_step(loss, finite=finite)
    info = engine.step()  # skipped when the gradients are non-finite
    return StepResult(info=info, bad=not loss_ok or (info.skipped and precision != "fp16"), samples=n_samples,
                      tokens=n_tokens)


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


