"""Combines the configured loss terms with their weights.

Each term is ``fn(fwd, cfg, ctx) -> (loss_sum, count, metrics)``; ``fwd`` computes the
forward passes lazily so terms sharing a pass (e.g. the views) run it once. Adding an
objective = a pure loss in ``objectives/`` + a term function + one line in ``OBJECTIVES``.

Normalisation (DESIGN.md): every term's ``loss_sum`` is divided by its count summed over
data-parallel ranks; the result is multiplied by the world size because DeepSpeed averages
gradients over ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.config.objective import ObjectiveConfig
from pretrain.config.train import OpsConfig
from pretrain.objectives.mlm import mlm_loss
from pretrain.objectives.nt_xent import nt_xent


@dataclass
class Context:
    env: object
    """DistEnv: rank/world for gathering negatives and reducing counts."""
    ops: OpsConfig
    pooling: str


class Forward:
    """Lazily computed forward passes of one micro-batch, shared by the loss terms."""

    def __init__(self, model, batch: dict, ctx: Context):
        self.model, self.batch, self.ctx = model, batch, ctx
        self._cache: dict = {}

    def mlm_hidden(self) -> torch.Tensor:
        if "mlm" not in self._cache:
            self._cache["mlm"] = self.model.encode(self.batch["input_ids"], self.batch["attention_mask"])
        return self._cache["mlm"]

    def view_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(z_a, z_b): both views through one encoder pass (padded together), pooled, projected."""
        if "views" not in self._cache:
            b = self.batch
            ids, mask = _stack_padded([b["view_a_ids"], b["view_b_ids"]], [b["view_a_mask"], b["view_b_mask"]])
            h = self.model.encode(ids, mask)
            z = self.model.projection(self.model.pool(h, mask, self.ctx.pooling))
            n = b["view_a_ids"].shape[0]
            self._cache["views"] = (z[:n], z[n:])
        return self._cache["views"]


def _stack_padded(ids_list, mask_list):
    t = max(x.shape[1] for x in ids_list)
    ids = torch.cat([torch.nn.functional.pad(x, (0, t - x.shape[1])) for x in ids_list])
    mask = torch.cat([torch.nn.functional.pad(m, (0, t - m.shape[1])) for m in mask_list])
    return ids, mask


def mlm_term(fwd: Forward, cfg, ctx: Context):
    logits, labels = fwd.model.mlm_logits(fwd.mlm_hidden(), fwd.batch["mlm_labels"])
    return mlm_loss(logits, labels)


def nt_xent_term(fwd: Forward, cfg, ctx: Context):
    z_a, z_b = fwd.view_projections()
    gather = ctx.env if (cfg.gather and ctx.env.is_distributed) else None
    return nt_xent(z_a, z_b, temperature=cfg.temperature, impl=ctx.ops.similarity,
                   chunk_size=ctx.ops.chunk_size, gather_env=gather)


OBJECTIVES = {
    "mlm": mlm_term,
    "nt_xent": nt_xent_term,
}


class Objective:
    """Runs the enabled terms on a micro-batch -> (loss for backward, raw sums for metrics)."""

    def __init__(self, cfg: ObjectiveConfig, ctx: Context):
        self.cfg, self.ctx = cfg, ctx
        self.terms = []
        for name in cfg.enabled():
            if name not in OBJECTIVES:
                raise ValueError(f"objective.{name} is configured but no loss term implements it; "
                                 f"available: {', '.join(OBJECTIVES)}")
            self.terms.append((name, OBJECTIVES[name], getattr(cfg, name)))

    def __call__(self, model, batch: dict):
        fwd = Forward(model, batch, self.ctx)
        sums, counts, metrics = {}, {}, {}
        for name, fn, term_cfg in self.terms:
            loss_sum, count, term_metrics = fn(fwd, term_cfg, self.ctx)
            sums[name], counts[name] = loss_sum, count
            metrics.update(term_metrics)
        global_counts = _reduce_counts([counts[n] for n, _, _ in self.terms], self.ctx.env)
        world = self.ctx.env.world_size
        loss = 0.0
        for (name, _, term_cfg), total in zip(self.terms, global_counts):
            if total > 0:
                loss = loss + term_cfg.weight * sums[name] * (world / total)
            metrics[name] = (sums[name].detach().item(), counts[name])
        if not torch.is_tensor(loss):
            loss = sum(s for s in sums.values()) * 0.0
        return loss, metrics


def _reduce_counts(counts: list, env) -> list[float]:
    if not env.is_distributed:
        return [float(c) for c in counts]
    t = torch.tensor(counts, dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return t.tolist()


class TrainModule(torch.nn.Module):
    """What DeepSpeed wraps: the model (saved as ``model.*``) plus the objective."""

    def __init__(self, model: torch.nn.Module, objective: Objective):
        super().__init__()
        self.model = model
        self.objective = objective

    def forward(self, batch: dict):
        return self.objective(self.model, batch)
