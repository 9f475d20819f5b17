"""AdamW parameter groups (no decay on biases and norms) and warmup + decay LR schedules."""

from __future__ import annotations

import math

import torch

from pretrain.config.train import OptimConfig
from pretrain.model.flat import is_decayed


def build_param_groups(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: weights (decayed) and biases/LayerNorm/1-d params (not decayed). Tied params once. A flattened
    layer's (model/flat.py) ``flat_decay`` holds only weights, its ``flat_no_decay`` only the others."""
    decay, no_decay, seen = [], [], set()
    for name, p in module.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        (decay if decayed(name, p) else no_decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def decayed(name: str, p: torch.Tensor) -> bool:
    """Whether AdamW decays parameter ``name`` (a flat tensor by its kind, others by ``flat.is_decayed``)."""
    if name.endswith(".flat_decay") or name == "flat_decay":
        return True
    if name.endswith(".flat_no_decay") or name == "flat_no_decay":
        return False
    return is_decayed(name, p)


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
