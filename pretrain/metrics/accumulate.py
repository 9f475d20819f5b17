"""Metric accumulation as (sum, count) pairs, reduced across ranks once per log interval."""

from __future__ import annotations

import torch

from pretrain.distributed.comm import all_reduce_host


class MetricSums:
    """Accumulates name -> (sum, count) without a host sync: tensors stay on their device (detached, in float64),
    Python numbers stay numbers; ``reduce`` sums both over ranks and fetches them in one transfer, once per log
    interval, and returns the means (NaN for a count of 0)."""

    def __init__(self) -> None:
        self._sums: dict[str, object] = {}
        self._counts: dict[str, object] = {}

    def add(self, name: str, value_sum, count, *, keep: torch.Tensor | None = None) -> None:
        """``keep``: a 0-dim bool tensor; where it is False this addition counts as nothing (decided on the
        device: a non-finite micro-batch's figures are dropped without the host looking at them)."""
        value_sum, count = _f64(value_sum), _f64(count)
        if keep is not None:
            value_sum = torch.where(keep, _on(value_sum, keep.device), 0.0)
            count = torch.where(keep, _on(count, keep.device), 0.0)
        self._sums[name] = self._sums.get(name, 0.0) + value_sum
        self._counts[name] = self._counts.get(name, 0.0) + count

    def set(self, name: str, value) -> None:
        """``name`` is ``value`` (a device tensor or a number), not a sum: the last one set counts, and over ranks
        the mean of theirs, which is the value itself for a figure every rank shares (the step's lr, grad norm)."""
        self._sums[name], self._counts[name] = _f64(value), 1.0

    def update(self, metrics: dict[str, tuple], *, keep: torch.Tensor | None = None) -> None:
        for name, (value_sum, count) in metrics.items():
            self.add(name, value_sum, count, keep=keep)

    def reduce(self, env=None) -> dict[str, float]:
        names = sorted(self._sums)
        if not names:
            return {}
        device = next((v.device for v in [*self._sums.values(), *self._counts.values()] if torch.is_tensor(v)),
                      torch.device("cpu"))
        t = torch.stack([torch.stack([_on(self._sums[n], device), _on(self._counts[n], device)]) for n in names])
        if env is not None and env.is_distributed:
            t = all_reduce_host(t.cpu())
        rows = t.tolist()  # the one device -> host transfer
        return {n: (s / c if c else float("nan")) for n, (s, c) in zip(names, rows)}

    def reset(self) -> None:
        self._sums.clear()
        self._counts.clear()


def _f64(x):
    return x.detach().to(torch.float64) if torch.is_tensor(x) else float(x)


def _on(x, device) -> torch.Tensor:
    """A 0-dim float64 tensor on ``device``; a Python number is filled in there (a kernel, not a copy)."""
    if torch.is_tensor(x):
        return x.to(device).reshape(())
    return torch.full((), x, dtype=torch.float64, device=device)
