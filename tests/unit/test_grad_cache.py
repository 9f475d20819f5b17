"""objective.gradient_cache on one process: the cached-gradient pass gives the parameters the whole step's gradient
(float32, chunked similarity op) as the float64 reference with every chunk's graph held computes it
(tests/grad_cache_reference.py), dropout on, for chunk sizes that divide the step and sizes that do not.
"""

from __future__ import annotations

import grad_cache_reference as R
import pytest
import torch

from pretrain.training.cached_step import chunk_rng

pytestmark = pytest.mark.usefixtures("one_thread", "dtype_free_dropout")


@pytest.fixture
def dtype_free_dropout(monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "dropout", R.dtype_free_dropout)


@pytest.mark.parametrize("case", list(R.CASES))
@pytest.mark.parametrize("sizes", [[5, 5], [4, 4, 2], [3, 1, 6]], ids=["5+5", "4+4+2", "3+1+6"])
def test_cached_gradient_equals_the_whole_step_gradient(case, sizes):
    module = R.case_module(case)
    chunks = R.split_chunks(R.step_batch(R.CASES[case][0], sum(sizes)), sizes)
    got, got_loss = R.cached_grads(module, chunks)
    want, want_loss = R.reference_grads(R.to_double(module), [R.as_double(c) for c in chunks])
    assert len(got) > 10 and all(float(g.abs().max()) > 0 for g in list(want.values())[:3])
    assert R.mismatch(got, want) == []
    assert got_loss == pytest.approx(want_loss, rel=1e-5)


def test_negatives_limited_to_a_chunk_give_another_gradient():
    """The bug the cache is for: uncached, each micro-step's terms see only its own micro-batch (gradients averaged
    over micro-steps, as DeepSpeed accumulates them), here with the same dropout masks as the whole step's."""
    module = R.to_double(R.case_module("clear"))
    chunks = [R.as_double(c) for c in R.split_chunks(R.step_batch("pretrain", 10), [5, 5])]
    want, _ = R.reference_grads(module, chunks)
    module.zero_grad(set_to_none=True)
    for k, chunk in enumerate(chunks):
        R.reference_grads(module, [chunk], [(0, k)], zero=False)  # adds this micro-step's gradient
    per_chunk = {n: g / len(chunks) for n, g in R.param_grads(module).items()}
    bad = R.mismatch(per_chunk, want)
    assert any(b.startswith("model.projection.") for b in bad), bad


def test_replay_draws_pass_one_dropout_masks_and_misses_without_it():
    """Pass 2 recomputes each chunk's embeddings bit for bit, with attention dropout on too (the real torch dropout:
    no float32 patch needed, one dtype); under another RNG key they differ, and so would the gradient."""
    module = R.case_module("clear")
    module.model.cfg.attention_dropout = 0.1
    for m in module.model.modules():
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.1
    chunk = R.split_chunks(R.step_batch("pretrain", 6), [6])[0]
    with torch.no_grad(), chunk_rng(R.SEED, R.STEP, 0, 0, "cpu"):
        first = module(chunk, embed_only=True)["views"]
    with chunk_rng(R.SEED, R.STEP, 0, 0, "cpu"):
        again = module.objective.forward_cache(module.model, chunk, module.heads).view_projections()
    with chunk_rng(R.SEED, R.STEP, 0, 1, "cpu"):
        other = module.objective.forward_cache(module.model, chunk, module.heads).view_projections()
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    assert again[0].requires_grad
    assert not torch.allclose(first[0], other[0])
