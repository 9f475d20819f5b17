"""train.compile_shapes=bucketed (training/step.py: Buckets, bucket_batch, host_facts): the compiled step's batches
padded to a few shapes give the unbucketed batch's losses, metrics and gradients."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_unpadded import _batch, _train_module, pairs_batch

from pretrain.config import load_run_config
from pretrain.config.data import IGNORE_INDEX
from pretrain.training.build import compile_options
from pretrain.training.step import Buckets, bucket_batch, host_facts

RTOL = 1e-5


def test_widths_round_up_to_the_bucket_capped_at_the_models_positions():
    b = Buckets(width=24, positions=16, max_width=60)
    assert [b.round(n, 24, 60) for n in (1, 24, 25, 49, 58, 60, 64)] == [24, 24, 48, 60, 60, 60, 64]
    batch = _batch()  # MLM rows 64 wide, views 32
    batch["view_a_ids"], batch["view_a_mask"] = batch["view_a_ids"][:, :20], batch["view_a_mask"][:, :20]
    out = bucket_batch(batch, Buckets(width=24, positions=16, max_width=60))
    assert out["input_ids"].shape[1] == 64  # never narrower than the batch
    assert out["view_a_ids"].shape[1] == 24 and out["view_b_ids"].shape[1] == 48
    assert not out["view_b_mask"][:, 32:].any() and torch.equal(out["view_b_mask"][:, :32], batch["view_b_mask"])
    assert (out["view_a_ids"][:, 20:] == 0).all()  # the batch's own padding id
    wide = bucket_batch(batch, Buckets(width=48))
    assert wide["input_ids"].shape[1] == 96 and (wide["mlm_labels"][:, 64:] == IGNORE_INDEX).all()
    assert wide["attention_mask"].shape == wide["input_ids"].shape == wide["mlm_labels"].shape


def test_mlm_positions_fill_their_bucket_with_unlabelled_tokens_and_keep_the_count():
    batch = _batch()
    real = int((batch["mlm_labels"] != IGNORE_INDEX).sum())
    out = host_facts(batch, buckets=Buckets(width=64, positions=64))
    pos = out["mlm_positions"].numpy()
    assert pos.size % 64 == 0 and pos.size >= real and out["host_counts"] == {"mlm": real}
    assert np.unique(pos).size == pos.size
    labels = out["mlm_labels"].numpy().reshape(-1)
    assert (labels[pos[:real]] != IGNORE_INDEX).all() and (labels[pos[real:]] == IGNORE_INDEX).all()
    with pytest.raises(ValueError, match="compiled step"):
        host_facts(batch, unpadded=True, buckets=Buckets())


@pytest.mark.parametrize("stage, trim", [("pretrain", True), ("pretrain", False), ("sentences", True)])
def test_bucketed_batches_give_the_same_losses_metrics_and_gradients(stage, trim):
    """MLM + CLEAR views ([CLS], the last layer trimmed or not), and the sentence stage's data.pairs (anchors,
    positives and hard negatives, each of another width)."""
    module = _train_module(pooling="cls" if stage == "pretrain" else "mean", stage=stage)
    module.objective.ctx.trim_last_layer = trim
    batch = _batch() if stage == "pretrain" else pairs_batch(3)
    results = []
    for buckets in (None, Buckets(width=48, positions=64, max_width=64)):  # the model's 64 positions
        module.zero_grad(set_to_none=True)
        facts = host_facts(batch, buckets=buckets)
        if buckets is not None and stage == "pretrain":
            assert facts["view_a_ids"].shape[1] == 48 and facts["mlm_positions"].numel() % 64 == 0
        elif buckets is not None:
            assert {facts[k].shape[1] for k in ("sentence_ids", "positive_ids", "negative_ids")} == {48}
        loss, metrics = module(facts)
        loss.backward()
        results.append((loss.detach(), {k: (float(v[0]), float(v[1])) for k, v in metrics.items()},
                        {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}))
    (loss0, metrics0, grads0), (loss1, metrics1, grads1) = results
    torch.testing.assert_close(loss1, loss0, rtol=RTOL, atol=1e-6)
    assert metrics1.keys() == metrics0.keys()
    for k in metrics0:
        assert metrics1[k][1] == metrics0[k][1], k  # the counts: real tokens, not the bucket
        assert metrics1[k][0] == pytest.approx(metrics0[k][0], rel=RTOL, abs=1e-6), k
    assert grads1.keys() == grads0.keys() and len(grads0) > 20
    for name, g in grads0.items():
        torch.testing.assert_close(grads1[name], g, rtol=0, atol=RTOL * float(g.abs().max()) + 1e-9,
                                   msg=lambda m, n=name: f"{n}: {m}")


def test_bucketed_is_static_graphs_and_only_with_the_compiled_step(tmp_path):
    cfg = load_run_config(None, ["train.compile=true", "train.compile_shapes=bucketed", "train.compile_bucket=32"])
    assert cfg.step_bucketed and compile_options(cfg.train)["dynamic"] is False
    assert not load_run_config(None, ["train.compile_shapes=bucketed"]).step_bucketed
    assert not load_run_config(None, ["train.compile=true", "train.compile_shapes=bucketed",
                                      "objective.gradient_cache=true"]).step_bucketed
    with pytest.raises(ValueError, match="compile_bucket"):
        load_run_config(None, ["train.compile_bucket=0"])
