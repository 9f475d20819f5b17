"""The Engine's gradient clip, decided on the device (``Engine.step``: DeepSpeed's formula, gradients divided by
max(1, (norm + 1e-6) / clip_grad_norm) inside the fused AdamW): a clipped step is the unclipped step of the same
gradients divided by that factor, under ZeRO 0 and 2, on a real DeepSpeed engine.

With eps = 1 >> |g| Adam's first update is lr * g / (|g| + 1), which sees the gradients' scale (with a small eps it
would be sign(g) and no clip could show): so the clipped engine's update must equal the update of an unclipped
engine whose loss is divided by the factor, and differ from the plain unclipped update. Each update also applies
the learning rate of the schedule at its count of updates (ZeRO 0-3)."""

from __future__ import annotations

import pytest
import torch

from pretrain.config import DistributedConfig, ModelConfig, ObjectiveConfig, OpsConfig, OptimConfig, TrainConfig
from pretrain.distributed.env import destroy_process_group, init_process_group, single_process_env

B, T, TV, V = 4, 16, 8, 200


def _batch() -> dict:
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(6, V, (B, T), generator=g)
    sel = torch.rand(B, T, generator=g) < 0.25
    labels = torch.full_like(ids, -100)
    labels[sel] = ids[sel]
    views = {f"view_{s}_ids": torch.randint(6, V, (B, TV), generator=g) for s in "ab"}
    return dict(input_ids=ids.masked_fill(sel, 4), attention_mask=torch.ones(B, T, dtype=torch.bool),
                mlm_labels=labels, view_a_mask=torch.ones(B, TV, dtype=torch.bool),
                view_b_mask=torch.ones(B, TV, dtype=torch.bool), **views)


def _one_step(zero_stage: int, clip: float, loss_factor: float = 1.0) -> tuple[list[torch.Tensor], float]:
    """(parameters after one step, the gradient norm the Engine measured) of a fresh tiny model."""
    from pretrain.distributed.engine import Engine
    from pretrain.model import build_model
    from pretrain.objective import Context, Objective, TrainModule
    from pretrain.training.optim import build_param_groups, lr_lambda

    env = single_process_env()
    torch.manual_seed(0)
    mcfg = ModelConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, max_position=32,
                       dropout=0.0, attention_dropout=0.0, pooling="mean")
    module = TrainModule(build_model(mcfg), Objective(ObjectiveConfig(), Context(env, OpsConfig(), "mean")))
    optim = OptimConfig(lr=1.0, eps=1.0, weight_decay=0.0, warmup_steps=0, clip_grad_norm=clip)
    engine = Engine(module, build_param_groups(module, optim.weight_decay), optim=optim,
                    train=TrainConfig(micro_batch_size=B, precision="fp32"), env=env,
                    dist=DistributedConfig(zero_stage=zero_stage), lr_lambda=lr_lambda(optim, 10))
    loss, _ = engine.forward(_batch())
    engine.micro_step(loss * loss_factor)
    info = engine.step()
    return [p.detach().clone() for p in module.parameters()], float(info.grad_norm)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_a_clipped_step_is_the_step_of_the_gradients_divided_by_the_clip(zero_stage, clean_env):
    init_process_group(single_process_env(), backend="gloo", timeout_s=60)
    try:
        start, _ = _one_step(zero_stage, 0.0, loss_factor=0.0)  # lr * 0 / (0 + 1): the initial parameters
        plain, norm = _one_step(zero_stage, 0.0)
        clip = norm / 8  # engages: the gradients are divided by about 8
        clipped, clipped_norm = _one_step(zero_stage, clip)
        factor = max(1.0, (clipped_norm + 1e-6) / clip)
        scaled, _ = _one_step(zero_stage, 0.0, loss_factor=1.0 / factor)
    finally:
        destroy_process_group()
    assert clipped_norm == pytest.approx(norm, rel=1e-6) and factor == pytest.approx(8.0, rel=1e-5)
    moved = max(float((c - s).abs().max()) for c, s in zip(clipped, start))
    assert moved > 1e-3
    for c, s in zip(clipped, scaled):
        torch.testing.assert_close(c, s, rtol=0, atol=moved * 1e-5)
    # and the clip did something: the unclipped step went elsewhere
    assert max(float((c - p).abs().max()) for c, p in zip(clipped, plain)) > moved / 4


@pytest.mark.parametrize("zero_stage", [0, 1, 2, 3])
def test_every_update_takes_the_schedules_learning_rate(zero_stage, clean_env, monkeypatch):
    """The learning rate the fused AdamW applies (and the Engine reports) at update t is lr * lr_lambda(t), with
    two micro-steps an update, under ZeRO-0, ZeRO 1-2 (DeepSpeed calls ``step`` once per parameter group) and
    ZeRO-3 (which empties the optimizer's ``param_groups`` outside its per-group calls; until 2026-12-06 every
    ZeRO-3 update took update 0's rate): a warmup over 4 updates, so each of the 3 updates has its own."""
    from pretrain.distributed.engine import Engine
    from pretrain.model import build_model
    from pretrain.objective import Context, Objective, TrainModule
    from pretrain.training.optim import build_param_groups, lr_lambda

    applied: list[list[float]] = []  # each update: its groups' learning rates at each of DeepSpeed's step calls
    adamw_step = torch.optim.AdamW.step

    def recording_step(self, *args, **kwargs):
        applied[-1] += [float(g["lr"]) for g in self.param_groups if g["params"]]
        return adamw_step(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.AdamW, "step", recording_step)
    init_process_group(single_process_env(), backend="gloo", timeout_s=60)
    try:
        env = single_process_env()
        torch.manual_seed(0)
        mcfg = ModelConfig(vocab_size=V, hidden_size=32, num_layers=2, num_heads=2, ffn_size=64, max_position=32,
                           dropout=0.0, attention_dropout=0.0, pooling="mean")
        module = TrainModule(build_model(mcfg), Objective(ObjectiveConfig(), Context(env, OpsConfig(), "mean")))
        optim = OptimConfig(lr=1e-3, warmup_steps=4, clip_grad_norm=1.0)
        engine = Engine(module, build_param_groups(module, optim.weight_decay), optim=optim,
                        train=TrainConfig(micro_batch_size=B, precision="fp32", grad_accum=2), env=env,
                        dist=DistributedConfig(zero_stage=zero_stage), lr_lambda=lr_lambda(optim, 10))
        reported = []
        for _ in range(3):
            applied.append([])
            for _ in range(2):
                loss, _ = engine.forward(_batch())
                engine.micro_step(loss)
            reported.append(float(engine.step().lr))
    finally:
        destroy_process_group()
    want = [1e-3 * (t + 1) / 4 for t in range(3)]
    assert all(applied), applied  # every update called the optimizer's step
    for t, lrs in enumerate(applied):
        assert lrs == pytest.approx([want[t]] * len(lrs), rel=1e-6), (t, lrs)
    assert reported == pytest.approx(want, rel=1e-6)
