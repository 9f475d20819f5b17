"""Metric accumulation as (sum, count) pairs, reduced across ranks once per log interval."""

from __future__ import annotations

from collections import defaultdict

import torch

from pretrain.distributed.comm import all_reduce_host


class MetricSums:
    """Accumulates name -> (sum, count); ``reduce`` sums both over ranks and returns the means."""

    def __init__(self) -> None:
        self._sums: dict[str, float] = defaultdict(float)
        self._counts: dict[str, float] = defaultdict(float)

    def add(self, name: str, value_sum, count) -> None:
        self._sums[name] += float(value_sum)
        self._counts[name] += float(count)

    def update(self, metrics: dict[str, tuple]) -> None:
        for name, (value_sum, count) in metrics.items():
            self.add(name, value_sum, count)

    def reduce(self, env=None) -> dict[str, float]:
        names = sorted(self._sums)
        if env is not None and env.is_distributed and names:
            t = torch.tensor([[self._sums[n], self._counts[n]] for n in names], dtype=torch.float64)
            t = all_reduce_host(t)
            sums = {n: t[i, 0].item() for i, n in enumerate(names)}
            counts = {n: t[i, 1].item() for i, n in enumerate(names)}
        else:
            sums, counts = dict(self._sums), dict(self._counts)
        return {n: (sums[n] / counts[n] if counts[n] else float("nan")) for n in names}

    def reset(self) -> None:
        self._sums.clear()
        self._counts.clear()
