"""objective.matryoshka: the loss is the weighted sum of every contrastive term on the truncated (re-normalised)
embeddings, checked against the pure losses on embeddings truncated by hand in float64; under
objective.gradient_cache the cached step gets the same gradient as the whole batch at once."""

from __future__ import annotations

import grad_cache_reference as R
import pytest
import torch

from pretrain.config.objective import (
    ConsistencyConfig,
    InfoNCEConfig,
    MatryoshkaConfig,
    ObjectiveConfig,
    ReconstructionConfig,
)
from pretrain.config.train import OpsConfig
from pretrain.losses.info_nce import info_nce
from pretrain.losses.ranking import cosine_matrix, js_consistency
from pretrain.objective import Context, Objective, TrainModule

pytestmark = pytest.mark.usefixtures("one_thread")

SIZES = [(16, 1.0), (8, 0.5), (4, 0.25)]


def _module(gradient_cache: bool = False) -> TrainModule:
    cfg = ObjectiveConfig(mlm=None, nt_xent=None, info_nce=InfoNCEConfig(weight=0.7, hard_negative_weight=2.0),
                          consistency=ConsistencyConfig(weight=0.3), gradient_cache=gradient_cache,
                          matryoshka=MatryoshkaConfig(dims=[8, 16, 4], weights=[0.5, 1.0, 0.25]))
    ctx = Context(env=R.ONE, ops=OpsConfig(similarity="torch", chunk_size=3), pooling="mean", stage="sentences")
    return TrainModule(R.tiny_model(1, dropout=0.0), Objective(cfg, ctx)).train()


def _reference_loss(module: TrainModule, batch: dict) -> float:
    """sum_d w_d * (0.7 InfoNCE + 0.3 consistency) / B on g(e[:d]) of anchors, positives and hard negatives."""
    model = module.model.double()
    e = {k: model.pool(model.encode(batch[f"{k}_ids"], batch[f"{k}_mask"]), batch[f"{k}_mask"], "mean")
         for k in ("sentence", "positive", "negative")}
    n = batch["sentence_ids"].shape[0]
    pos = torch.arange(n)
    total = 0.0
    for dim, weight in SIZES:
        cut = {k: v.clone() for k, v in e.items()}
        for v in cut.values():
            v[:, dim:] = 0.0  # truncated to the first dim coordinates
        z1, z2, z3 = (model.projection(cut[k]) for k in ("sentence", "positive", "negative"))
        nce, _, _ = info_nce(z1, z2, pos, temperature=0.05, neg_MD=z3, neg_weight=2.0)
        cons, _, _ = js_consistency(cosine_matrix(z1, z2), cosine_matrix(z2, z1), temperature=0.05)
        total += weight * (0.7 * float(nce) + 0.3 * float(cons)) / n
    return total


def test_loss_is_the_weighted_sum_of_the_terms_at_each_size():
    module = _module()
    batch = R.step_batch("pairs", 6)
    with torch.no_grad():
        loss, metrics = module(batch)
        want = _reference_loss(module, R.as_double(batch))
    assert float(loss) == pytest.approx(want, rel=1e-5)
    assert {"info_nce_dim16", "info_nce_dim8", "info_nce_dim4", "consistency_dim4"} <= metrics.keys()
    # A size's metric is that size's term alone: the largest size's equals the term without Matryoshka.
    plain = TrainModule(R.tiny_model(1, dropout=0.0), Objective(
        ObjectiveConfig(mlm=None, nt_xent=None, info_nce=InfoNCEConfig(weight=0.7, hard_negative_weight=2.0)),
        Context(env=R.ONE, ops=OpsConfig(similarity="torch", chunk_size=3), pooling="mean", stage="sentences")))
    with torch.no_grad():
        _, plain_metrics = plain(batch)
    assert float(metrics["info_nce_dim16"][0]) == pytest.approx(float(plain_metrics["info_nce"][0]), rel=1e-5)


def test_cached_step_gradient_equals_the_whole_batch_gradient():
    module = _module(gradient_cache=True)
    batch = R.step_batch("pairs", 7)
    got, got_loss = R.cached_grads(module, R.split_chunks(batch, [4, 3]))
    module.zero_grad(set_to_none=True)
    loss, _ = module(batch)
    loss.backward()
    assert R.mismatch(got, R.param_grads(module)) == []
    assert got_loss == pytest.approx(float(loss.detach()), rel=1e-5)


def test_pretraining_views_under_the_cache_too():
    """CLEAR's NT-Xent on the views (and the MLM term, not truncated) at two sizes, cached over chunks of 3 and 2."""
    from pretrain.config.objective import MLMConfig, NTXentConfig

    cfg = ObjectiveConfig(mlm=MLMConfig(), nt_xent=NTXentConfig(), gradient_cache=True,
                          matryoshka=MatryoshkaConfig(dims=[16, 4]))
    ctx = Context(env=R.ONE, ops=OpsConfig(similarity="torch", chunk_size=3), pooling="cls", stage="pretrain")
    module = TrainModule(R.tiny_model(1, dropout=0.0), Objective(cfg, ctx)).train()
    batch = R.step_batch("pretrain", 5)
    got, got_loss = R.cached_grads(module, R.split_chunks(batch, [3, 2]))
    module.zero_grad(set_to_none=True)
    loss, metrics = module(batch)
    loss.backward()
    assert R.mismatch(got, R.param_grads(module)) == []
    assert got_loss == pytest.approx(float(loss.detach()), rel=1e-5)
    assert {"nt_xent_dim16", "nt_xent_dim4"} <= metrics.keys() and "mlm_dim4" not in metrics


def test_config_checks():
    with pytest.raises(ValueError, match="objective.matryoshka.dims must be distinct sizes >= 1"):
        MatryoshkaConfig(dims=[8, 8])
    with pytest.raises(ValueError, match="one weight > 0 per size"):
        MatryoshkaConfig(dims=[8, 4], weights=[1.0])
    assert MatryoshkaConfig(dims=[4, 16]).sizes() == [(16, 1.0), (4, 1.0)]
    with pytest.raises(ValueError, match="use one of them"):
        ObjectiveConfig(mlm=None, nt_xent=None, info_nce=InfoNCEConfig(), reconstruction=ReconstructionConfig(),
                        matryoshka=MatryoshkaConfig(dims=[4]))
    with pytest.raises(ValueError, match="has 32, larger than the sentence embedding \\(16"):  # when built
        TrainModule(R.tiny_model(1, dropout=0.0), Objective(
            ObjectiveConfig(mlm=None, nt_xent=None, info_nce=InfoNCEConfig(), matryoshka=MatryoshkaConfig(dims=[32])),
            Context(env=R.ONE, ops=OpsConfig(), pooling="mean", stage="sentences")))
