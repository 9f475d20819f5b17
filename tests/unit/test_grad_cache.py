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


def test_a_chunk_without_triplets_steps_at_zero3_as_at_zero2(clean_env, monkeypatch):
    """ArcCSE's triplet term on a chunk with no triplet rows is a zero tied to the projection head (every parameter
    gets its gradient). ZeRO-3 holds the head's parameters as empty tensors outside its own call: the zero then
    took a gradient of shape [0] and backward failed ("SumBackward0 returned an invalid gradient") in the cached
    step. Every parameter partitioned between uses (tests/zero3_partitioned.py); the step is ZeRO-2's."""
    import pretrain.distributed.engine as engine_mod
    from pretrain.config import DistributedConfig, OptimConfig, TrainConfig
    from pretrain.distributed.env import destroy_process_group, init_process_group, single_process_env
    from pretrain.metrics.accumulate import MetricSums
    from pretrain.training.cached_step import cached_optimizer_step
    from pretrain.training.optim import build_param_groups, lr_lambda
    from zero3_partitioned import partitioned

    monkeypatch.setattr(engine_mod, "build_ds_config", partitioned(engine_mod.build_ds_config))
    chunks = R.split_chunks(R.step_batch("sentences", 8), [4, 4])
    chunks[1].update({k: v[:0] for k, v in chunks[1].items() if k.startswith("triplet_")})
    env = single_process_env()
    init_process_group(env, backend="gloo", timeout_s=60)
    results = {}
    try:
        for stage in (2, 3):
            torch.manual_seed(0)  # the same module for both stages
            module = R.case_module("simcse_arccse", env=env)
            optim = OptimConfig(lr=1e-2, warmup_steps=0)
            engine = engine_mod.Engine(module, build_param_groups(module, optim.weight_decay), optim=optim,
                                       train=TrainConfig(micro_batch_size=4, grad_accum=2), env=env,
                                       dist=DistributedConfig(zero_stage=stage), lr_lambda=lr_lambda(optim, 10))
            it, sums = iter([dict(c) for c in chunks]), MetricSums()
            cached_optimizer_step(engine, it.__next__, sums, env=env, grad_accum=2, seed=R.SEED, step=R.STEP,
                                  precision="fp32")
            results[stage] = (R.gathered_weights(module), sums.reduce(env)["loss"])
    finally:
        destroy_process_group()
    (w2, loss2), (w3, loss3) = results[2], results[3]
    assert loss3 == pytest.approx(loss2, rel=1e-5)
    for name in w2:
        torch.testing.assert_close(w3[name], w2[name], rtol=0, atol=1e-5, msg=name)
