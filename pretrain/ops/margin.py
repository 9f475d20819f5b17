"""ArcCon's additive angular margin on the positive logit, with a gradient that stays finite.

    f(c) = cos(acos(clamp(c, -1, 1)) + m) = c~ cos m - sqrt(1 - c~^2) sin m,   c~ = clamp(c, -1, 1)

The exact derivative, sin(theta + m) / sin(theta), diverges at theta = 0 and pi (duplicate or
opposite embeddings) for m > 0. We define

    f'(c) = cos m + c~ sin m / max(sin theta, SIN_FLOOR)

which equals the exact derivative wherever sin theta >= SIN_FLOOR (theta outside ~0.57 degrees of 0
or pi), is continuous everywhere, and is bounded by cos m + sin m / SIN_FLOOR. With m = 0 the caller
skips this function entirely, so plain InfoNCE sees exactly c (no clamp).
Legend: N rows.
"""

from __future__ import annotations

import math

import torch

SIN_FLOOR = 1e-2
"""Lower bound on sin(theta) in the margin gradient (see module docstring)."""


def arc_margin_value(c_N: torch.Tensor, margin: float) -> torch.Tensor:
    """f(c) of the module docstring, elementwise, no autograd."""
    c_N = c_N.clamp(-1.0, 1.0)
    sin_N = (1.0 - c_N * c_N).clamp_min(0.0).sqrt()
    return c_N * math.cos(margin) - sin_N * math.sin(margin)


def arc_margin_grad(c_N: torch.Tensor, margin: float) -> torch.Tensor:
    """f'(c) of the module docstring, elementwise."""
    c_N = c_N.clamp(-1.0, 1.0)
    sin_N = (1.0 - c_N * c_N).clamp_min(0.0).sqrt()
    return math.cos(margin) + c_N * math.sin(margin) / sin_N.clamp_min(SIN_FLOOR)


class _ArcMargin(torch.autograd.Function):
    @staticmethod
    def forward(ctx, c_N, margin: float):
        ctx.save_for_backward(c_N)
        ctx.margin = margin
        return arc_margin_value(c_N, margin)

    @staticmethod
    def backward(ctx, grad_N):
        (c_N,) = ctx.saved_tensors
        return grad_N * arc_margin_grad(c_N, ctx.margin), None


def arc_margin(c_N: torch.Tensor, margin: float) -> torch.Tensor:
    """cos(acos(c) + margin) with the bounded gradient above; margin in radians."""
    return _ArcMargin.apply(c_N, float(margin))
