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
    """step -> multiplier of cfg.lr: linear warmup, then linear/cosine decay to min_lr_ratio, or constant."""
    warmup = cfg.warmup_steps
    floor = cfg.min_lr_ratio

    def fn(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        if cfg.schedule == "constant":
            return 1.0
        span = max(1, max_steps - warmup)
        progress = min(1.0, (step - warmup) / span)
        if cfg.schedule == "cosine":
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))
        return floor + (1 - floor) * (1 - progress)

    return fn
