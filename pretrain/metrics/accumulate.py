"""Metric accumulation as (sum, count) pairs, reduced across ranks once per log interval."""

from __future__ import annotations

import torch

from pretrain.distributed.comm import all_reduce_host


class MetricSums:
    """Accumulates name -> (sum, count) without a host sync: tensors stay on their device (detached, in float64),
    Python numbers stay numbers; ``reduce`` sums both over ranks and fetches them in one transfer, once per log
    interval, and returns the means (NaN for a count of 0).

    A micro-step's metrics with a ``keep`` flag (``update``, every micro-step of training) are accumulated together
    (``_Batched``): a handful of aten ops a micro-step in all, where one ``add`` a metric took ~9 (on a GPU each a
    kernel launch the host pays for: ~70 a micro-step for the CLEAR recipe's figures)."""

    def __init__(self) -> None:
        self._sums: dict[str, object] = {}
        self._counts: dict[str, object] = {}
        self._batched: dict[tuple, _Batched] = {}
        """``update``'s metrics by their names and kinds (one entry while the objective returns the same ones)."""

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
        """``add`` of every (name, (value_sum, count)) with the same ``keep``. With ``keep`` and 0-dim tensor sums
        on its device (a training micro-step), all of them at once (``_Batched``): the same sums and counts."""
        if keep is None or not _batchable(metrics, keep):
            for name, (value_sum, count) in metrics.items():
                self.add(name, value_sum, count, keep=keep)
            return
        kinds = tuple((v.dtype, c.dtype if torch.is_tensor(c) else None) for v, c in metrics.values())
        key = (tuple(metrics), kinds)
        batched = self._batched.get(key)
        if batched is None:
            batched = self._batched[key] = _Batched(tuple(metrics), kinds)
        batched.add(list(metrics.values()), keep)

    def reduce(self, env=None, *, per_rank: dict[str, float] | None = None) -> dict:
        """The means over ranks (one transfer, one all-reduce; collective where distributed). ``per_rank``: host
        numbers of this rank's own (its data-wait fraction) that come back as the list of every rank's, in rank
        order, from the same all-reduce (each rank fills its slot of a world-size vector); every rank passes the
        same names."""
        totals, by_rank = self._reduced(env, per_rank or {})
        return {**{n: (s / c if c else float("nan")) for n, (s, c) in totals.items()}, **by_rank}

    def totals(self, env=None) -> dict[str, list[float]]:
        """name -> [sum, count] summed over ranks (one transfer, one all-reduce; collective where distributed)."""
        return self._reduced(env, {})[0]

    def _reduced(self, env, per_rank: dict[str, float]) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
        names = sorted(set(self._sums).union(*(b.names for b in self._batched.values())))
        if not names and not per_rank:
            return {}, {}
        pairs = sorted(self._sums)
        device = next((v.device for v in [*self._sums.values(), *self._counts.values(),
                                          *(b.keeps[0] for b in self._batched.values())] if torch.is_tensor(v)),
                      torch.device("cpu"))
        pieces = [torch.stack([torch.stack([_on(self._sums[n], device), _on(self._counts[n], device)])
                               for n in pairs]).reshape(-1)] if pairs else []
        for b in self._batched.values():
            pieces += b.pieces(device)
        fetched = torch.cat(pieces).tolist() if pieces else []  # the one device -> host transfer
        totals = {n: [0.0, 0.0] for n in names}
        for i, n in enumerate(pairs):
            totals[n] = fetched[2 * i:2 * i + 2]
        at = 2 * len(pairs)
        for b in self._batched.values():
            at = b.settle(fetched, at, totals)
        distributed = env is not None and env.is_distributed
        world, rank = (env.world_size, env.rank) if distributed else (1, 0)
        slots = [0.0] * (len(per_rank) * world)
        for i, value in enumerate(per_rank.values()):
            slots[i * world + rank] = float(value)
        flat = [v for n in names for v in totals[n]] + slots
        if distributed:
            flat = all_reduce_host(torch.tensor(flat, dtype=torch.float64)).tolist()
        at = 2 * len(names)
        by_rank = {name: flat[at + i * world:at + (i + 1) * world] for i, name in enumerate(per_rank)}
        return {n: flat[2 * i:2 * i + 2] for i, n in enumerate(names)}, by_rank

    def reset(self) -> None:
        self._sums.clear()
        self._counts.clear()
        self._batched.clear()


class _Batched:
    """``update``'s metrics of one set of names and kinds, accumulated together. Per micro-step: the value sums (and
    any count that is a tensor) stacked by dtype, cast to float64, masked by ``keep`` and added into one float64
    vector on the device (a few ops in all); the counts that are numbers stay on the host beside the micro-step's
    ``keep`` flag, and ``reduce``, which fetches the flags with the sums, adds up those of the kept micro-steps.
    Each figure is summed in the order ``add`` sums it, in float64: the same values."""

    def __init__(self, names: tuple[str, ...], kinds: tuple) -> None:
        self.names = names
        # (kind, index, dtype) of every figure on the device: each sum, and each count that is a tensor
        slots = [("sum", i, v) for i, (v, _) in enumerate(kinds)] + [("count", i, c) for i, (_, c) in enumerate(kinds)
                                                                       if c is not None]
        self.groups = [[(kind, i) for kind, i, d in slots if d == dtype]
                       for dtype in dict.fromkeys(d for *_, d in slots)]
        """The device figures by dtype (first appearance), the order of the accumulated vector."""
        self.host_counts = [i for i, (_, c) in enumerate(kinds) if c is None]
        self.acc: torch.Tensor | None = None
        self.keeps: list[torch.Tensor] = []
        self.counts: list[list[float]] = []

    def add(self, pairs: list[tuple], keep: torch.Tensor) -> None:
        with torch.no_grad():
            parts = [torch.stack([pairs[i][0 if kind == "sum" else 1] for kind, i in group]).to(torch.float64)
                     for group in self.groups]
            vec = torch.where(keep, parts[0] if len(parts) == 1 else torch.cat(parts), 0.0)
            self.acc = vec if self.acc is None else self.acc.add_(vec)
        self.keeps.append(keep)
        self.counts.append([float(pairs[i][1]) for i in self.host_counts])

    def pieces(self, device) -> list[torch.Tensor]:
        """What ``reduce`` fetches: the accumulated vector, then the keep flags (float64)."""
        return [self.acc.to(device), torch.stack(self.keeps).to(device=device, dtype=torch.float64)]

    def settle(self, fetched: list[float], at: int, totals: dict) -> int:
        """Adds this batch's sums and counts (read from ``fetched`` at ``at``) into ``totals``; returns the offset
        after them."""
        figures = {}
        for slot in (s for group in self.groups for s in group):
            figures[slot], at = fetched[at], at + 1
        kept, at = fetched[at:at + len(self.keeps)], at + len(self.keeps)
        for j, i in enumerate(self.host_counts):
            count = 0.0
            for flag, row in zip(kept, self.counts):
                count += row[j] if flag else 0.0  # as add's float64 where(keep, count, 0.0), one micro-step each
            figures[("count", i)] = count
        for i, name in enumerate(self.names):
            total = totals[name]
            total[0] += figures[("sum", i)]
            total[1] += figures[("count", i)]
        return at


def _batchable(metrics: dict, keep: torch.Tensor) -> bool:
    """``update``'s batched path: every sum a 0-dim tensor on ``keep``'s device, every count a number or such a
    tensor."""
    def scalar(x) -> bool:
        return torch.is_tensor(x) and x.dim() == 0 and x.device == keep.device

    return bool(metrics) and all(scalar(v) and (scalar(c) or isinstance(c, (int, float)))
                                 for v, c in metrics.values())


def _f64(x):
    return x.detach().to(torch.float64) if torch.is_tensor(x) else float(x)


def _on(x, device) -> torch.Tensor:
    """A 0-dim float64 tensor on ``device``; a Python number is filled in there (a kernel, not a copy)."""
    if torch.is_tensor(x):
        return x.to(device).reshape(())
    return torch.full((), x, dtype=torch.float64, device=device)
