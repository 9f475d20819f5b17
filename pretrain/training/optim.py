"""AdamW parameter groups (no decay on biases and norms) and warmup + decay LR schedules."""

from __future__ import annotations

import math

import torch

from pretrain.config.train import OptimConfig


def build_param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: weights (decayed) and biases/LayerNorm/1-d params (not decayed). Tied params once."""
    decay, no_decay, seen = [], [], set()
    for name, p in module.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.ndim < 2 or name.endswith(".bias") or "norm" in name.lower():
            no_decay.append(p)
        else:
            decay.append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def lr_lambda(cfg: OptimConfig, max_steps: int):
    """step -> multiplier of cfg.lr: linear warmup, then linear/cosine decay to min_lr_ratio, or constant.

    ``step`` is an int, or a tensor (the optimizer's own count of applied updates, on its device): the multiplier
    is then computed there, in float64, with no host sync (the Engine's optimizer sets its learning rate so)."""
    warmup = cfg.warmup_steps
    floor = cfg.min_lr_ratio
    span = max(1, max_steps - warmup)

    def fn(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        progress = min(1.0, (step - warmup) / span)
        if cfg.schedule == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * (1 - progress)

    def fn_t(step_t: torch.Tensor) -> torch.Tensor:
        step_t = step_t.to(torch.float64)
        if cfg.schedule == "constant":
            after = torch.ones_like(step_t)
        else:
            progress = torch.clamp((step_t - warmup) / span, max=1.0)
            shape = 0.5 * (1 + torch.cos(math.pi * progress)) if cfg.schedule == "cosine" else 1 - progress
            after = floor + (1 - floor) * shape
        return torch.where(step_t < warmup, (step_t + 1) / warmup, after) if warmup else after

    return lambda step: fn_t(step) if torch.is_tensor(step) else fn(step)
