"""The cached-gradient pass (``objective.gradient_cache``; GradCache, Gao et al. 2021): the terms that compare
sentences with each other see the whole optimizer step, while only one chunk's activations are held.

    pass 1  each chunk k (a micro-batch), no graph:       E_k = its embeddings                  embed_chunk
    stage   E = cat_k E_k as leaves, every rank's gathered: contrastive terms -> loss_C,
            and the cached gradient G = d loss_C / d E                                          contrast
    pass 2  each chunk k again, with a graph and pass 1's dropout masks:
            loss_k = <E_k, G_k> + chunk k's per-sample terms; backward                          replay_chunk

sum_k d<E_k, G_k>/dθ = sum_k J_k^T G_k = d loss_C/dθ (chain rule through E), so the parameters get the whole
batch's gradient. Per-sample terms are normalised by their count over the whole step (and all ranks), known after
pass 1, so they too add up to the whole batch's.

A chunk's embeddings E_k: CLEAR's views (``views``, nt_xent), the pair (``pair``: info_nce, arccon, consistency,
rank_distill; in pretraining the views themselves, with SARCSE the autoencoder's Z), data.pairs' hard negatives
(``negative``: info_nce, arccon) and RankCSE's teachers' embeddings (``teacher``, no gradient). Which terms are which:

- CONTRASTIVE (whole step): nt_xent, info_nce, arccon, consistency, rank_distill: each compares a sentence with
  the batch's other sentences.
- per-sample (pass 2, per chunk): mlm; triplet (ArcCSE's triplet compares a sentence with its own two masked
  copies only, and runs without dropout); reconstruction (SARCSE reconstructs each sentence's own tokens; its
  autoencoder's Z is what info_nce compares, and that part is cached).

Dropout: the caller runs both passes of chunk k under one RNG key per (seed, step, rank, k); pass 2 computes the
embeddings first, in pass 1's order, so it draws pass 1's masks (teachers run in eval mode and draw nothing).
Legend: B chunk rows, S = sum of a rank's chunk rows, P embedding dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pretrain.config.data import IGNORE_INDEX
from pretrain.objective.forward import Forward
from pretrain.objective.matryoshka import run_term

CONTRASTIVE = frozenset({"nt_xent", "info_nce", "arccon", "consistency", "rank_distill"})
"""Terms that compare sentences with each other: under objective.gradient_cache they see the whole step."""

PAIR_TERMS = frozenset({"info_nce", "arccon", "consistency", "rank_distill"})
"""Terms that read ``Forward.pair``."""

HARD_NEGATIVE_TERMS = frozenset({"info_nce", "arccon"})
"""Terms that read ``Forward.hard_negatives`` (data.pairs' third column)."""

SOURCES = ("views", "pair", "negative")
"""The embedding passes a chunk can cache, in the order both passes run them."""


def _mlm_count(fwd: Forward) -> int:
    b = fwd.batch
    if "mlm_positions" in b:  # the host counted them (training/step.py: host_facts): a shape, no sync
        return b["mlm_positions"].numel()
    return int((b["mlm_labels"] != IGNORE_INDEX).sum())


def _triplet_count(fwd: Forward) -> int:
    return fwd.batch["triplet_index"].numel() if "triplet_index" in fwd.batch else 0


def _reconstruction_count(fwd: Forward) -> int:
    known = fwd.batch.get("host_counts", {}).get("reconstruction")
    if known is not None:  # the host counted them (training/step.py: host_facts)
        return known
    _, _, _, content_mask, _, n = fwd.autoencoded()  # computed for the pair already
    return int((content_mask[:n].sum(-1) > 0).sum())  # reconstruction_loss's count (a host sync, as there)


SAMPLE_COUNTS = {"mlm": _mlm_count, "triplet": _triplet_count, "reconstruction": _reconstruction_count}
"""Per-sample terms -> their count in a chunk, from pass 1's forward cache: what normalises them over the step."""


@dataclass
class ChunkGrads:
    """What pass 2 of one chunk needs: the cached gradient of each embedding and the per-sample terms' totals."""

    grads: dict
    """``views``/``pair`` -> (g_a_BP, g_b_BP), ``negative`` -> (g_BP,), in the order pass 1 embedded them."""
    totals: dict
    """Per-sample term -> its count over the whole step and all ranks."""


@dataclass
class StepCache:
    loss: torch.Tensor
    """The contrastive terms' weighted loss over the whole step (0-dim, detached)."""
    metrics: dict
    chunks: list[ChunkGrads]


def check_terms(names) -> None:
    """Every configured term is either contrastive or a per-sample term whose count pass 1 can tell."""
    unknown = [n for n in names if n not in CONTRASTIVE and n not in SAMPLE_COUNTS]
    if unknown:
        raise ValueError(f"objective.gradient_cache does not know how to cache {', '.join(unknown)}: a term is either "
                         f"contrastive ({', '.join(sorted(CONTRASTIVE))}) or per-sample with a count in "
                         f"pretrain/objective/grad_cache.py: SAMPLE_COUNTS")


def _sources(fwd: Forward, names: set) -> list[str]:
    """The passes the contrastive terms read: ``views`` and/or ``pair`` (the pair *is* the views in pretraining
    without the autoencoder: then only ``views``), then data.pairs' hard negatives (``negative``)."""
    pair_is_views = fwd.ctx.stage != "sentences" and "autoencoder" not in fwd.heads
    out = []
    if "nt_xent" in names or (names & PAIR_TERMS and pair_is_views):
        out.append("views")
    if names & PAIR_TERMS and not pair_is_views:
        out.append("pair")
    if names & HARD_NEGATIVE_TERMS and "negative_ids" in fwd.batch:
        out.append("negative")
    return out


def _embed(fwd: Forward, source: str) -> tuple[torch.Tensor, ...]:
    if source == "negative":
        return (fwd.hard_negatives(),)
    return fwd.view_projections() if source == "views" else fwd.pair()


def embed_chunk(objective, model, batch: dict, heads) -> dict:
    """Pass 1 of a chunk (the caller holds no_grad and the chunk's RNG key): {source: (z_a_BP, z_b_BP),
    "teacher": [(t1, t2) per teacher], "counts": {per-sample term: count}}."""
    names = {n for n, _, _ in objective.terms}
    fwd = objective.forward_cache(model, batch, heads, gather=False)
    out = {source: tuple(z.detach() for z in _embed(fwd, source)) for source in _sources(fwd, names)}
    if "rank_distill" in names:
        out["teacher"] = fwd.teacher_embeddings()
    out["counts"] = {n: SAMPLE_COUNTS[n](fwd) for n in names if n not in CONTRASTIVE}
    return out


def contrast(objective, embedded: list[dict]) -> StepCache:
    """The contrastive terms on the whole step's embeddings (every chunk of this rank, gathered over ranks by the
    terms themselves) -> their loss, metrics and each chunk's cached gradient."""
    sources = [s for s in SOURCES if s in embedded[0]]
    rows = [c[sources[0]][0].shape[0] for c in embedded] if sources else []
    cached = {s: tuple(_leaf(torch.cat([c[s][i] for c in embedded])) for i in range(len(embedded[0][s])))
              for s in sources}
    leaves = [z for s in sources for z in cached[s]]
    if "teacher" in embedded[0]:
        cached["teacher"] = [tuple(torch.cat([c["teacher"][t][i] for c in embedded]) for i in (0, 1))
                             for t in range(len(embedded[0]["teacher"]))]
    if "negative" in cached:
        cached["negative"] = cached["negative"][0]  # Forward.hard_negatives's value: one tensor
    fwd = Forward(None, {}, objective.ctx, gather=objective.gather, teachers=objective.teachers, cached=cached)
    terms = [t for t in objective.terms if t[0] in CONTRASTIVE]
    sample_terms = [n for n, _, _ in objective.terms if n not in CONTRASTIVE]
    sums, counts, metrics = {}, {}, {}
    with torch.enable_grad():
        for name, fn, term_cfg in terms:
            sums[name], counts[name], term_metrics = run_term(name, fn, fwd, term_cfg, objective.ctx,
                                                              objective.sizes)
            metrics.update(term_metrics)
    step_counts = [sum(c["counts"][n] for c in embedded) for n in sample_terms]
    totals = objective.global_counts([counts[n] for n, _, _ in terms] + step_counts)  # one collective
    loss = objective.weighted(terms, sums, totals[:len(terms)])
    for name, _, _ in terms:
        metrics[name] = (sums[name].detach(), counts[name])
    grads = [None] * len(leaves)
    if leaves and torch.is_tensor(loss) and loss.requires_grad:
        grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(z) if g is None else g for z, g in zip(leaves, grads)]
    per_source, at = {}, 0
    for s in sources:
        width = len(embedded[0][s])
        per_source[s], at = tuple(grads[at:at + width]), at + width
    sample_totals = dict(zip(sample_terms, totals[len(terms):]))
    chunks = [ChunkGrads(grads={s: tuple(g[lo:hi] for g in gs) for s, gs in per_source.items()},
                         totals=sample_totals)
              for lo, hi in _bounds(rows if rows else [0] * len(embedded))]
    loss = loss.detach() if torch.is_tensor(loss) else torch.zeros(())
    return StepCache(loss=loss, metrics=metrics, chunks=chunks)


def replay_chunk(objective, model, batch: dict, heads, cached: ChunkGrads):
    """Pass 2 of a chunk (the caller holds the chunk's RNG key) -> (loss for backward, the per-sample terms' weighted
    loss (detached), metrics). The loss for backward is <E_k, G_k> + the per-sample terms, each normalised by its
    count over the step."""
    fwd = objective.forward_cache(model, batch, heads, gather=False)
    surrogate = 0.0
    for source, grads in cached.grads.items():  # first, as in pass 1: the same dropout masks
        for z, g in zip(_embed(fwd, source), grads):
            surrogate = surrogate + (z.float() * g.float()).sum()
    terms = [t for t in objective.terms if t[0] not in CONTRASTIVE]
    sums, counts, metrics = {}, {}, {}
    for name, fn, term_cfg in terms:
        sums[name], counts[name], term_metrics = fn(fwd, term_cfg, objective.ctx)
        metrics.update(term_metrics)
        metrics[name] = (sums[name].detach(), counts[name])
    value = objective.weighted(terms, sums, [cached.totals[n] for n, _, _ in terms])
    if not torch.is_tensor(value):
        value = torch.zeros(())
    return surrogate + value, value.detach(), metrics


def _leaf(z: torch.Tensor) -> torch.Tensor:
    """A leaf of the stage's graph: the embeddings' own dtype (the terms' arithmetic as without the cache), but
    fp32 for fp16, whose small cached gradients would underflow unscaled."""
    return z.detach().to(torch.float32 if z.dtype == torch.float16 else z.dtype).requires_grad_()


def _bounds(rows: list[int]):
    lo = 0
    for n in rows:
        yield lo, lo + n
        lo += n

