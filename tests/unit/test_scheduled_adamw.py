"""The Engine's fused AdamW (``engine.ScheduledAdamW``): its clip (``grad_scale``, divided inside torch's fused
kernel) and its veto (``found_inf``) against AdamW written out in float64, over several steps with a schedule."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.distributed.engine import ScheduledAdamW

LR, BETAS, EPS, WD = 0.05, (0.9, 0.999), 1e-8, 0.01


def _lr_lambda(step: torch.Tensor) -> torch.Tensor:
    return 1.0 / (1.0 + step)  # a schedule that moves every step (AdamW's count: updates applied so far)


def _reference(params, grads_per_step, scales, skips):
    """float64 AdamW (decoupled weight decay) on grads / scale, skipping the vetoed steps entirely."""
    ps = [p.double().clone() for p in params]
    m = [torch.zeros_like(p) for p in ps]
    v = [torch.zeros_like(p) for p in ps]
    t = 0
    for grads, scale, skip in zip(grads_per_step, scales, skips):
        if skip:
            continue
        lr = LR * _lr_lambda(torch.tensor(float(t))).item()
        t += 1
        for p, g, m_, v_ in zip(ps, grads, m, v):
            g = g.double() / scale
            p.mul_(1 - lr * WD)
            m_.mul_(BETAS[0]).add_(g, alpha=1 - BETAS[0])
            v_.mul_(BETAS[1]).addcmul_(g, g, value=1 - BETAS[1])
            denom = (v_ / (1 - BETAS[1] ** t)).sqrt() + EPS
            p.addcdiv_(m_, denom, value=-lr / (1 - BETAS[0] ** t))
    return ps, t


@pytest.mark.parametrize("clip", [False, True])
def test_the_clip_and_the_veto_inside_the_fused_step_are_adamws_on_the_clipped_gradients(clip):
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(shape, generator=gen)) for shape in ((7, 5), (33,), (2, 3, 4))]
    start = [p.detach().clone() for p in params]
    opt = ScheduledAdamW([{"params": params, "weight_decay": WD}], lr=LR, lr_lambda=_lr_lambda, betas=BETAS, eps=EPS)
    grads_per_step, scales, skips = [], [], []
    for step in range(6):
        grads = [torch.randn(p.shape, generator=gen) * (1 + 3 * step) for p in params]
        skip = step == 3
        norm = math.sqrt(sum(float(g.double().square().sum()) for g in grads))
        # the Engine's clip: max(1, (norm + 1e-6) / max_norm), here with max_norm 2 (it engages on every step)
        scale = max(1.0, (norm + 1e-6) / 2.0) if clip else 1.0
        for p, g in zip(params, grads):
            p.grad = g.clone()
        opt.found_inf = torch.tensor(float(skip))
        opt.grad_scale = torch.tensor(scale, dtype=torch.float32) if clip else None
        before = [p.detach().clone() for p in params]
        opt.step()
        if skip:  # vetoed: parameters and step count as they were
            assert all(torch.equal(a, p.detach()) for a, p in zip(before, params))
        grads_per_step.append(grads), scales.append(float(torch.tensor(scale, dtype=torch.float32))), skips.append(skip)
        assert all(isinstance(g["lr"], float) and g["lr"] == LR for g in opt.param_groups)  # the float kept
    expected, applied = _reference(start, grads_per_step, scales, skips)
    assert float(opt.applied_steps()) == applied == 5
    for p, e, s in zip(params, expected, start):
        moved = (e - s.double()).abs().max()
        assert moved > 1e-3  # the steps moved every tensor
        torch.testing.assert_close(p.detach().double(), e, rtol=0, atol=float(moved) * 1e-5)
    if clip:  # the clip changed the result: the same steps unclipped end elsewhere
        unclipped, _ = _reference(start, grads_per_step, [1.0] * 6, skips)
        assert max(float((u - e).abs().max()) for u, e in zip(unclipped, expected)) > 1e-3
