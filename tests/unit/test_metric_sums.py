"""metrics/accumulate.py: a training micro-step's metrics accumulated together (``MetricSums.update`` with a keep
flag) give the sums and counts one ``add`` per metric gives, exactly, against a float64 reference summed in plain
Python; in a few aten ops and no sync."""

from __future__ import annotations

import math
import random

import pytest
import torch

from pretrain.metrics.accumulate import MetricSums
from pretrain.metrics.op_count import OpCounter


def _micro_step(rng: random.Random, names=("loss", "mlm", "mlm_acc", "cl_acc", "nt_xent", "uniform")) -> dict:
    """Figures as the objective returns them: fp32/bf16 sums, int64 sums (accuracy counts), counts as Python ints,
    floats or int64 tensors."""
    out = {}
    for i, name in enumerate(names):
        kind = i % 3
        if kind == 0:
            value, count = torch.tensor(rng.uniform(-5, 5), dtype=torch.float32), rng.randint(1, 300)
        elif kind == 1:
            value, count = torch.tensor(rng.uniform(0, 9), dtype=torch.bfloat16), torch.tensor(rng.randint(1, 50))
        else:
            value, count = torch.tensor(rng.randint(0, 40)), float(rng.randint(1, 40)) / 4
        out[name] = (value, count)
    return out


def _reference(steps: list[tuple[dict, bool]]) -> dict[str, float]:
    """Sums of the kept micro-steps' figures in float64, one after another, and their means."""
    sums: dict[str, list[float]] = {}
    for metrics, kept in steps:
        for name, (value, count) in metrics.items():
            total = sums.setdefault(name, [0.0, 0.0])
            if kept:
                total[0] += float(value.double())
                total[1] += float(count.double()) if torch.is_tensor(count) else float(count)
    return {n: (s / c if c else math.nan) for n, (s, c) in sums.items()}


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_batched_update_equals_one_add_a_metric_and_a_float64_reference(seed):
    rng = random.Random(seed)
    steps = []
    for k in range(25):
        metrics, kept = _micro_step(rng), rng.random() > 0.25
        if not kept:  # a non-finite micro-step: its figures must not reach the sums
            metrics["loss"] = (torch.tensor(math.nan), metrics["loss"][1])
            metrics["mlm"] = (torch.tensor(math.inf, dtype=torch.bfloat16), metrics["mlm"][1])
        steps.append((metrics, kept))
    batched, per_metric = MetricSums(), MetricSums()
    for metrics, kept in steps:
        keep = torch.tensor(kept)
        batched.update(metrics, keep=keep)
        for name, (value, count) in metrics.items():
            per_metric.add(name, value, count, keep=keep)
    assert len(batched._batched) == 1 and not batched._sums  # the batched path ran
    got, want = batched.reduce(), per_metric.reduce()
    assert got == want  # exactly: the same float64 additions
    reference = _reference(steps)
    assert got.keys() == reference.keys()
    for name in got:
        assert got[name] == pytest.approx(reference[name], rel=1e-12), name


def test_set_add_and_batched_updates_reduce_together_and_reset():
    rng = random.Random(5)
    sums, steps = MetricSums(), []
    for i in range(6):
        names = ("loss", "mlm") if i % 2 else ("loss", "mlm", "cl_acc")  # two sets of names: two batches
        metrics = _micro_step(rng, names)
        steps.append((metrics, True))
        sums.update(metrics, keep=torch.tensor(True))
    sums.set("lr", 1e-4)
    sums.set("grad_norm", torch.tensor(2.5))
    sums.add("bad.count", torch.tensor(3.0), 1)
    assert len(sums._batched) == 2
    got = sums.reduce()
    reference = _reference(steps)
    assert got.keys() == reference.keys() | {"lr", "grad_norm", "bad.count"}
    for name in reference:
        assert got[name] == pytest.approx(reference[name], rel=1e-12), name
    assert (got["lr"], got["grad_norm"], got["bad.count"]) == (1e-4, 2.5, 3.0)
    sums.reset()
    assert sums.reduce() == {}


def test_a_micro_steps_update_takes_a_few_ops_and_no_sync():
    rng = random.Random(3)
    metrics = _micro_step(rng, tuple(f"m{i}" for i in range(9)))
    keep = torch.tensor(True)
    sums = MetricSums()
    sums.update(metrics, keep=keep)  # the first builds the batch's layout
    with OpCounter() as batched:
        sums.update(metrics, keep=keep)
    with OpCounter() as per_metric:
        for name, (value, count) in metrics.items():
            MetricSums().add(name, value, count, keep=keep)
    assert batched.num_sync == 0 and per_metric.num_sync == 0
    assert batched.num_aten <= 12 < 5 * 9 <= per_metric.num_aten, (batched.ops, per_metric.ops)


def test_figures_that_are_not_device_scalars_take_one_add_each():
    sums = MetricSums()
    sums.update({"host": (2.0, 1), "num": (torch.tensor(1.0), 1)}, keep=torch.tensor(True))
    assert not sums._batched and set(sums._sums) == {"host", "num"}
    sums.update({"plain": (3.0, 2)})  # no keep flag: add as before
    assert sums.reduce() == {"host": 2.0, "num": 1.0, "plain": 1.5}
