"""Alignment/uniformity vs a torch (SimCSE-formula) reference; KCC/NDCG vs hand-computed references."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from pretrain.eval.alignment_uniformity import (
    alignment,
    alignment_uniformity,
    uniformity,
)
from pretrain.eval.ranking import ndcg, ranking_metrics, ranking_samples
from pretrain.eval.sts import StsSubset, StsTask


def test_alignment_uniformity_match_torch_reference():
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((300, 16)), rng.standard_normal((300, 16))
    xt = torch.nn.functional.normalize(torch.tensor(x, dtype=torch.float64), dim=1)
    yt = torch.nn.functional.normalize(torch.tensor(y, dtype=torch.float64), dim=1)
    ref_align = (xt - yt).norm(dim=1).pow(2).mean().item()
    ref_uniform = torch.pdist(xt, p=2).pow(2).mul(-2).exp().mean().log().item()
    assert alignment(x, y) == pytest.approx(ref_align, rel=1e-10)
    assert uniformity(x, chunk=64) == pytest.approx(ref_uniform, rel=1e-10)  # chunking must not matter
    assert uniformity(x, chunk=10_000) == pytest.approx(ref_uniform, rel=1e-10)


def test_alignment_uniformity_on_task():
    sub = StsSubset(name="s", sent_a=["a", "b", "c"], sent_b=["b", "c", "d"], gold=np.array([4.5, 1.0, 5.0]))
    vec = {"a": [1.0, 0.0], "b": [0.0, 1.0], "c": [1.0, 1.0], "d": [-1.0, 0.0]}
    res = alignment_uniformity(lambda ss: np.array([vec[s] for s in ss]), StsTask(name="t", subsets=[sub]))
    assert res["num_pos"] == 2 and res["num_sentences"] == 4
    ab, cd = 2.0, 2 + np.sqrt(2)  # squared distances of unit vectors: a-b, c-d
    assert res["align"] == pytest.approx((ab + cd) / 2)


def kendall_ref(p, g):
    """Tau-a by counting pairs (equal to tau-b without ties)."""
    s = sum(np.sign(p[i] - p[j]) * np.sign(g[i] - g[j]) for i, j in itertools.combinations(range(len(p)), 2))
    return s / (len(p) * (len(p) - 1) / 2)


def test_ndcg_and_kcc_reference():
    rng = np.random.default_rng(1)
    p, g = rng.permutation(6).astype(float), rng.permutation(6).astype(float) + 0.5
    disc = [1 / np.log2(r + 1) for r in range(1, 7)]
    dcg = sum(g[i] * disc[r] for r, i in enumerate(np.argsort(-p)))
    idcg = sum(v * disc[r] for r, v in enumerate(sorted(g, reverse=True)))
    assert ndcg(p, g) == pytest.approx(dcg / idcg)
    assert ndcg(g, g) == pytest.approx(1.0)
    # one anchor "x" with 4 partners (a sample), "y" with 3 (not a sample, k must exceed 3)
    a = ["x", "x", "q", "x", "y", "y", "y"]
    b = ["p1", "p2", "x", "p3", "r1", "r2", "r3"]
    gold = np.array([5.0, 1.0, 3.0, 2.0, 1.0, 2.0, 3.0])
    pred = np.array([0.9, 0.2, 0.1, 0.5, 0.3, 0.2, 0.1])
    task = StsTask(name="t", subsets=[StsSubset(name="s", sent_a=a, sent_b=b, gold=gold)])
    samples = ranking_samples(task, [pred])
    assert len(samples) == 1 and sorted(samples[0][1]) == [1.0, 2.0, 3.0, 5.0]
    m = ranking_metrics(task, [pred])
    px, gx = pred[[0, 1, 2, 3]], gold[[0, 1, 2, 3]]
    assert m["num_samples"] == 1
    assert m["kcc"] == pytest.approx(100 * kendall_ref(px, gx))
    assert m["ndcg"] == pytest.approx(100 * ndcg(px, gx))
