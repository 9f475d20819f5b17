"""Combines the configured loss terms with their weights: ``Objective`` and the module DeepSpeed wraps.

The package: ``forward`` (the per-micro-batch forward cache and the terms' ``Context``), ``terms`` (one
function per objective, ``OBJECTIVES``, RankCSE's ``Teachers``) and this composer. Each term is
``fn(fwd, cfg, ctx) -> (loss_sum, count, metrics)``; ``matryoshka`` runs the contrastive ones at every size of
objective.matryoshka. Teachers and SARCSE's token frequencies are
resolved by the caller (``pretrain.training.resources``) and passed in: nothing here reads data or
checkpoints.

Normalisation (docs/architecture.md, "Contracts"): every term's ``loss_sum`` is divided by its count summed over
data-parallel ranks; the result is multiplied by the world size because DeepSpeed averages
gradients over ranks.

The seed objectives (SimCSE info_nce, ArcCSE arccon + triplet, RankCSE consistency +
rank_distill, SARCSE reconstruction) work on a *pair* of embeddings (z1, z2): in the sentence
stage two dropout passes of the same sentence (one forward of the doubled batch), in
pretraining batches CLEAR's two augmented views (the pass nt_xent uses). Embeddings are
pool -> projection, or the SARCSE autoencoder's Z when reconstruction is on. With ``gather``,
the keys are every rank's z2 (gathered with gradient), row i's positive at rank * B + i.

Legend: B local rows, M = W * B gathered rows, T tokens, D hidden, P embedding dim,
Bt sentences with a triplet, V vocabulary.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings

import torch
from torch.fx.experimental import _config as fx_config

from pretrain.config.objective import ObjectiveConfig
from pretrain.distributed.comm import all_reduce_host
from pretrain.model.autoencoder import TextCNNAutoencoder
from pretrain.model.flat import mark_plans_constant, release_views
from pretrain.objective.forward import Context, Forward
from pretrain.objective.grad_cache import (
    CONTRASTIVE,
    ChunkGrads,
    check_terms,
    embed_chunk,
    replay_chunk,
)
from pretrain.objective.matryoshka import run_term
from pretrain.objective.terms import OBJECTIVES, SELF_WEIGHTED, Teachers

__all__ = ["OBJECTIVES", "SELF_WEIGHTED", "Context", "Forward", "Objective", "Teachers", "TrainModule"]


class Objective:
    """Runs the enabled terms on a micro-batch -> (loss for backward, raw sums for metrics)."""

    def __init__(self, cfg: ObjectiveConfig, ctx: Context, *, teachers: Teachers | None = None,
                 token_freq_V: torch.Tensor | None = None):
        self.cfg = cfg
        self.sizes = cfg.matryoshka.sizes() if cfg.matryoshka is not None else None
        """objective.matryoshka's (d, w_d), largest first; None = off."""
        self.ctx = dataclasses.replace(ctx, matryoshka_dims=tuple(d for d, _ in self.sizes)) if self.sizes else ctx
        self.terms = []
        for name in cfg.enabled():
            if name not in OBJECTIVES:
                raise ValueError(f"objective.{name} is configured but no loss term implements it; "
                                 f"available: {', '.join(OBJECTIVES)}")
            self.terms.append((name, OBJECTIVES[name], getattr(cfg, name)))
        names = [name for name, _, _ in self.terms]
        _check_stage(names, self.ctx.stage)
        # One pass for the MLM rows and the views serves only an objective that reads both (every term but MLM's
        # reads the views in pretraining); the gradient cache runs its own passes (grad_cache.py).
        joint = "mlm" in names and len(names) > 1 and self.ctx.stage == "pretrain" and not cfg.gradient_cache
        if self.ctx.joint_pass and not joint:
            self.ctx = dataclasses.replace(self.ctx, joint_pass=False)
        pair_cfg = cfg.info_nce or cfg.arccon
        if cfg.info_nce is not None and cfg.arccon is not None and cfg.info_nce.gather != cfg.arccon.gather:
            # One pair, one set of keys: arccon's setting would otherwise be ignored without a word.
            raise ValueError(f"objective.info_nce.gather={cfg.info_nce.gather} and objective.arccon.gather="
                             f"{cfg.arccon.gather} differ, but both terms (and consistency/rank_distill) read the same "
                             "pair, whose keys are gathered from every rank or not: set both the same")
        self.gather = bool(pair_cfg is not None and pair_cfg.gather)
        self.teachers = teachers
        if cfg.rank_distill is not None and teachers is None:
            raise ValueError("objective.rank_distill needs its teachers: load them with "
                             "pretrain.training.resources.load_teachers(cfg.rank_distill) and pass teachers=")
        self.token_freq_V = token_freq_V
        if cfg.reconstruction is not None and token_freq_V is None:
            raise ValueError("objective.reconstruction needs token frequencies: resolve them with "
                             "pretrain.training.resources.resolve_token_freq and pass token_freq_V=")
        if cfg.gradient_cache:
            check_terms(cfg.enabled())

    def build_heads(self, model) -> torch.nn.ModuleDict:
        """Trainable modules the terms add on top of the model (SARCSE's autoencoder); empty otherwise."""
        heads = torch.nn.ModuleDict()
        rc = self.cfg.reconstruction
        if rc is not None:
            heads["autoencoder"] = TextCNNAutoencoder(model.cfg.hidden_size, tuple(rc.kernel_sizes), rc.channels,
                                                      rc.integrate_channels)
        return heads

    def forward_cache(self, model, batch: dict, heads=None, *, gather: bool | None = None) -> Forward:
        """The forward cache of one micro-batch (``gather``: this objective's setting unless given)."""
        return Forward(model, batch, self.ctx, heads=heads, gather=self.gather if gather is None else gather,
                       teachers=self.teachers, token_freq_V=self.token_freq_V)

    def __call__(self, model, batch: dict, heads=None, *, run_terms=None, anchor=None):
        """-> (loss, metrics). ``run_terms``: ``self.run_terms`` or its compiled form (``TrainModule.compile_step``);
        the counts' reduction over ranks (host values, one collective) and the weighting stay outside it.
        ``anchor``: see ``run_terms``."""
        sums, counts, metrics = (run_terms or self.run_terms)(model, batch, heads, anchor)
        # Counts the host knows (training/step.py: host_facts): bucketed MLM positions, SARCSE's sentences.
        for name, count in batch.get("host_counts", {}).items():
            if name in counts:
                counts[name] = count
                acc = metrics.get(f"{name}_acc")
                if acc is not None:
                    metrics[f"{name}_acc"] = (acc[0], count)
        loss = self.weighted(self.terms, sums, self.global_counts([counts[n] for n, _, _ in self.terms]))
        for name, _, _ in self.terms:
            metrics[name] = (sums[name].detach(), counts[name])  # a tensor: no host sync mid-step
        if not torch.is_tensor(loss):
            loss = sum(s for s in sums.values()) * 0.0
        return loss, metrics

    def run_terms(self, model, batch: dict, heads=None, anchor=None) -> tuple[dict, dict, dict]:
        """The encoder passes and every term on a micro-batch -> (loss_sum, count and metrics per term): the
        forward and the losses, what ``train.compile`` compiles as one graph.

        ``anchor``: a 0-dim zero that requires grad (``Engine.forward`` under ZeRO-3 with the compiled step), added
        x 0 to every term's sum, which it leaves bit for bit as it was. Its gradient comes out of the same backward
        node as every parameter's, and DeepSpeed reduces the gradients of a whole-module gather when the module's
        inputs' gradients are computed (see ``Engine``)."""
        fwd = self.forward_cache(model, batch, heads)
        sums, counts, metrics = {}, {}, {}
        for name, fn, term_cfg in self.terms:
            loss_sum, count, term_metrics = run_term(name, fn, fwd, term_cfg, self.ctx,
                                                     self.sizes if name in CONTRASTIVE else None)
            if anchor is not None:
                loss_sum = loss_sum + (anchor * 0.0).to(loss_sum.dtype)
            sums[name], counts[name] = loss_sum, count
            metrics.update(term_metrics)
        return sums, counts, metrics

    def global_counts(self, counts: list) -> list[float]:
        """Host counts summed over the data-parallel ranks (one collective)."""
        return _reduce_counts(counts, self.ctx.env)

    def weighted(self, terms: list, sums: dict, totals: list):
        """sum_t weight_t * loss_sum_t * world / total_t over ``terms`` (name, fn, cfg): the world factor undoes
        DeepSpeed's average of the gradients over ranks. A term whose total is 0 (no masked position on any rank)
        enters x 0: its parameters get zero gradients, as they do from the compiled step (whose backward returns
        every input's) and from ZeRO 1-2's flat buffers, not none (which AdamW at ZeRO-0 would skip: no decay,
        no moment update, only in eager ZeRO-0 steps). 0.0 (a float) when there are no terms."""
        world = self.ctx.env.world_size
        loss = 0.0
        for (name, _, term_cfg), total in zip(terms, totals):
            weight = 1.0 if name in SELF_WEIGHTED else term_cfg.weight
            loss = loss + (weight * sums[name] * (world / total) if total > 0 else sums[name] * 0.0)
        return loss


STAGE_OF = {"nt_xent": ("pretrain", "objective.nt_xent needs CLEAR's augmented views, which only data.stage=pretrain "
                                  "makes; in the sentence stage use objective.info_nce or objective.arccon"),
            "triplet": ("sentences", "objective.triplet needs ArcCSE's triplet views, which only the sentence stage "
                                     "makes (data.stage=sentences data.sentences=FILE)")}
"""Terms whose inputs only one data stage makes -> (that stage, what to do): refused when the objective is built,
not at the first step."""


def _check_stage(names: list[str], stage: str) -> None:
    for name in names:
        needed, why = STAGE_OF.get(name, (stage, ""))
        if needed != stage:
            raise ValueError(f"{why} (data.stage={stage})")


def _reduce_counts(counts: list, env) -> list[float]:
    if not env.is_distributed:
        return [float(c) for c in counts]
    return all_reduce_host(torch.tensor(counts, dtype=torch.float64)).tolist()


def recompile_limit_message(dynamic: bool | None, limit: int) -> str:
    """The warning once the compiled step has as many graphs as torch makes of a function (``limit``), with what to
    change for torch.compile's ``dynamic`` (train.compile_shapes dynamic: True, auto: None, static, bucketed: False)."""
    fix = ("static and bucketed shapes compile a graph per batch shape: train.compile_shapes=dynamic compiles one "
           "for every shape, and under bucketed a larger train.compile_bucket makes fewer shapes" if dynamic is False
           else "TORCH_LOGS=recompiles names the guards that failed")
    return (f"train.compile: the compiled step has {limit} graphs, torch's limit (torch._dynamo.config."
            f"recompile_limit): from now on a batch that none of them fits runs eagerly, slower (and under "
            f"compile_mode=reduce-overhead without a CUDA graph); {fix}")


class TrainModule(torch.nn.Module):
    """What DeepSpeed wraps: the model (saved as ``model.*``), the objective's trainable heads
    (``heads.*``, e.g. SARCSE's autoencoder) and the objective (teachers stay outside: not parameters)."""

    def __init__(self, model: torch.nn.Module, objective: Objective):
        super().__init__()
        self.model = model
        self.heads = objective.build_heads(model) if hasattr(objective, "build_heads") else torch.nn.ModuleDict()
        width = getattr(getattr(model, "cfg", None), "sentence_dim", None)
        too_wide = [d for d, _ in getattr(objective, "sizes", None) or () if width is not None and d > width]
        if too_wide:  # refused here, not by the first step's forward
            raise ValueError(f"objective.matryoshka.dims has {', '.join(map(str, too_wide))}, larger than the sentence "
                             f"embedding ({width}: model.hidden_size, or model.dense_dim); every size must be "
                             f"<= {width}")
        teachers = getattr(objective, "teachers", None)
        if teachers is not None and hasattr(model, "cfg"):  # refused at start, not at the first step
            teachers.check_student(model.cfg.vocab_size)
        self.objective = objective
        self._run_terms = None
        """The compiled ``objective.run_terms`` after ``compile_step``; None runs it eagerly."""
        self._mix_t = None
        """The compiled step's views' mean-pooling weight (``set_view_mean_mix``), a 0-dim tensor."""

    @property
    def compiled_step(self) -> bool:
        """Whether the step's forward and losses run compiled (``compile_step``)."""
        return self._run_terms is not None

    def set_view_mean_mix(self, weight: float) -> None:
        """objective.nt_xent.mean_pool_warmup_steps: the views' share of mean pooling from this step on
        (``Context.view_mean_mix``). The compiled step takes a weight > 0 as a 0-dim tensor on the model's device,
        the same one every step: its floats are constants (``compile_step``), and a float that changes every step
        would compile a graph each. The tensor is written here, between steps, after the last backward read it."""
        if weight > 0.0 and self.compiled_step:
            if self._mix_t is None:
                self._mix_t = torch.zeros((), device=next(self.model.parameters()).device)
            weight = self._mix_t.fill_(weight)
        self.objective.ctx.view_mean_mix = weight

    def compile_step(self, **compile_kwargs) -> None:
        """torch.compile the forward and the loss terms of a micro-batch as one graph (``Objective.run_terms``;
        ``compile_kwargs`` go to torch.compile: backend, mode, dynamic). The gradient cache's passes stay eager."""
        from torch._dynamo import config as dynamo_config  # here: an eager run does not import torch._dynamo
        from torch._dynamo.exc import FailOnRecompileLimitHit

        mark_plans_constant()  # flat layers: their plans are constants to the trace (model/flat.py)
        compiled = torch.compile(self.objective.run_terms, **compile_kwargs)
        limit_hit = False

        def run_terms(*args, **kwargs):
            nonlocal limit_hit
            # No duck sizing: sizes equal in the batch that is traced would share one symbol, and a size that
            # one of them is pinned to would pin the other (the unpadded step's attention groups: a group of the
            # views' 64-token width took their row count's symbol, pinned by the micro-batch size, and the next
            # batch recompiled). Floats are constants: traced as symbols, the ones an op takes as a number
            # (LayerNorm's eps, dropout's p) must be fixed, which torch does by tracing the whole step a second
            # time (its log: "Restarting analysis due to _tensorify_python_scalars"), and the model's floats do
            # not change between steps (the one weight that does comes as a tensor: ``set_view_mean_mix``).
            with fx_config.patch(use_duck_shape=False):
                # Past torch's recompile limit a batch that no graph fits runs eagerly for the rest of the process,
                # said only once in torch's log. Asked to raise there instead (before the step's first op runs),
                # torch lets this warn once; this batch and later ones then run as torch runs them past the limit.
                try:  # one config patch a call: this runs every micro-step
                    with dynamo_config.patch(specialize_float=True, fail_on_recompile_limit_hit=not limit_hit):
                        return compiled(*args, **kwargs)
                except FailOnRecompileLimitHit:
                    limit_hit = True
                    limit = dynamo_config.recompile_limit
                    warnings.warn(recompile_limit_message(compile_kwargs.get("dynamic"), limit), stacklevel=2)
                with dynamo_config.patch(specialize_float=True):
                    return compiled(*args, **kwargs)

        self._run_terms = run_terms

    def forward(self, batch: dict, anchor=None, *, embed_only: bool = False, cached: ChunkGrads | None = None):
        """The objective on a micro-batch -> (loss, metrics). Under objective.gradient_cache (every pass runs through
        here, so that DeepSpeed's ZeRO-3 hooks gather the parameters): ``embed_only``, pass 1 of a chunk ->
        its embeddings; ``cached``, pass 2 -> (loss for backward, per-sample loss, metrics). ``anchor``: a
        positional tensor input, so that DeepSpeed's module backward hook sees one (``Objective.run_terms``)."""
        release_views(self.model)  # flat parameters: this pass's graph gets views of its own (model/flat.py)
        if embed_only:
            return embed_chunk(self.objective, self.model, batch, self.heads)
        if cached is not None:
            return replay_chunk(self.objective, self.model, batch, self.heads, cached)
        # Only the training step enters the compiled function. Validation's batches come without the host's facts
        # (training/step.py: host_facts), so the MLM head's boolean gather would break the graph there, and
        # torch.compile then skips the function for good: every later training step would run it eagerly, its
        # callees compiled one by one (measured on the H200, 2026-11-27). Validation runs no backward, so it
        # gains nothing from the compiled step anyway.
        compiled = self._run_terms if self.training and torch.is_grad_enabled() else None
        # eager: the tied word table's gradient as rows (model.py)
        with self.model.word_rows() if compiled is None else contextlib.nullcontext():
            return self.objective(self.model, batch, self.heads, run_terms=compiled, anchor=anchor)
