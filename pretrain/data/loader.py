"""Resumable, data-parallel sharded loading of micro-batches.

Shape legend: N = samples per epoch, M = micro-batch size per rank, W = world size.

The global sample stream is the concatenation of epoch permutations (epoch e is
``default_rng([seed, e]).permutation(N)``); global position p is sample
``perm_{p // N}[p % N]`` of epoch ``p // N``. Each micro-step consumes M * W consecutive
positions and rank r takes the r-th contiguous block of M. A global batch is a run of
consecutive micro-steps, so the set of samples in each global batch depends only on the
position, never on how it is split over ranks and accumulation steps: resuming at
``consumed = steps * global_batch`` works for any world size with the same global batch.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

import numpy as np
import torch

from pretrain.data.collate import collate


class SampleOrder:
    """The global (epoch, index) order of a dataset of ``num_samples``, independent of world size."""

    def __init__(self, num_samples: int, *, seed: int):
        if num_samples <= 0:
            raise ValueError(f"cannot iterate a dataset with {num_samples} samples; check data.sources")
        self.num_samples = int(num_samples)
        self.seed = int(seed)
        self._epoch = -1
        self._perm_N = np.zeros(0, dtype=np.int64)

    def permutation(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch``'s order, int64[N] (the latest one is cached)."""
        if epoch != self._epoch:
            self._perm_N = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
            self._epoch = epoch
        return self._perm_N

    def keys(self, start: int, count: int) -> list[tuple[int, int]]:
        """(epoch, index) of global positions start .. start + count - 1 (may span epochs)."""
        out = []
        pos, end = start, start + count
        while pos < end:
            epoch, offset = divmod(pos, self.num_samples)
            take = min(end - pos, self.num_samples - offset)
            out.extend((epoch, int(i)) for i in self.permutation(epoch)[offset : offset + take])
            pos += take
        return out

    def rank_keys(self, step_start: int, micro_batch_size: int, rank: int, world_size: int) -> list[tuple[int, int]]:
        """This rank's micro-batch of the micro-step that begins at global position ``step_start``."""
        return self.keys(step_start + rank * micro_batch_size, micro_batch_size)


class RankBatchSampler:
    """Infinite batch sampler: lists of (epoch, index) keys for one rank, from ``start``."""

    def __init__(self, order: SampleOrder, *, rank: int, world_size: int, micro_batch_size: int, start: int):
        self.order = order
        self.rank, self.world_size, self.micro_batch_size = rank, world_size, micro_batch_size
        self.start = start

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        step = self.micro_batch_size * self.world_size
        pos = self.start
        while True:
            yield self.order.rank_keys(pos, self.micro_batch_size, self.rank, self.world_size)
            pos += step


def _worker_init(worker_id: int) -> None:
    from pretrain.training.signals import ignore_in_worker

    torch.set_num_threads(1)
    ignore_in_worker()  # SIGTERM/SIGINT/SIGUSR1 to the process group: the main process decides


class ResumableLoader:
    """Iterable over this rank's collated micro-batches; ``consumed_samples`` counts global
    samples handed to the caller (all ranks), which is the position to checkpoint."""

    def __init__(self, loader: torch.utils.data.DataLoader, sampler: RankBatchSampler, start_sample: int):
        self.loader = loader
        self.sampler = sampler
        self.consumed_samples = start_sample

    def __iter__(self) -> Iterator[dict]:
        # A new iterator restarts at the current position (persistent workers are reused).
        self.sampler.start = self.consumed_samples
        step = self.sampler.micro_batch_size * self.sampler.world_size
        for batch in self.loader:
            self.consumed_samples += step
            yield batch

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples}


def build_loader(
    dataset,
    *,
    seed: int,
    rank: int,
    world_size: int,
    micro_batch_size: int,
    start_sample: int,
    num_workers: int,
    pad_id: int,
    prefetch_factor: int = 4,
    collate_fn=collate,
) -> ResumableLoader:
    """Infinite loader of this rank's micro-batches from global position ``start_sample``.

    ``start_sample`` (consumed global samples) must be a multiple of micro_batch_size * world_size.
    ``collate_fn(samples, pad_id)`` builds the batch (pretraining samples by default).
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in a world of size {world_size}")
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
    step = micro_batch_size * world_size
    if start_sample < 0 or start_sample % step:
        raise ValueError(
            f"start_sample {start_sample} must be a non-negative multiple of micro_batch_size * world_size = {step}; "
            "resume with a global batch size that divides the checkpoint's consumed samples"
        )
    order = SampleOrder(len(dataset), seed=seed)
    sampler = RankBatchSampler(order, rank=rank, world_size=world_size, micro_batch_size=micro_batch_size,
                               start=start_sample)
    extra = {}
    if num_workers > 0:
        extra = dict(persistent_workers=True, prefetch_factor=prefetch_factor, worker_init_fn=_worker_init)
    loader = torch.utils.data.DataLoader(
        dataset,
        batch_sampler=sampler,
        num_workers=num_workers,
        collate_fn=functools.partial(collate_fn, pad_id=pad_id),
        # A private generator: creating iterators must not consume the trainer's global torch RNG.
        generator=torch.Generator().manual_seed(int(seed)),
        **extra,
    )
    return ResumableLoader(loader, sampler, start_sample)
