"""objective.matryoshka (Matryoshka representation learning, Kusupati et al. 2022): a contrastive term applied at
several truncated sizes of the sentence embedding e, weighted:

    loss_sum = sum_d w_d * term(g(e[:d] zero-padded))        count = the term's count (one per size, all equal)

where g is the projection the terms see through (``Forward.embed(nested=True)`` computes g(e[:d]) for every size d
in one tensor, one block per size; ``TruncatedForward`` shows a term one block). The losses normalise their inputs,
so each size's embeddings are re-normalised. e[:d] is what sentence-transformers' ``truncate_dim=d`` returns of the
exported model (its embedding is e). The metrics are the largest size's, plus ``<term>_dim<d>`` per size.
"""

from __future__ import annotations

from pretrain.objective.forward import TruncatedForward


def run_term(name: str, fn, fwd, term_cfg, ctx, sizes: list[tuple[int, float]] | None):
    """``fn(fwd, term_cfg, ctx)`` -> (loss_sum, count, metrics), at every (d, w_d) of ``sizes`` (largest first, the
    order of ``Context.matryoshka_dims``) when given."""
    if not sizes:
        return fn(fwd, term_cfg, ctx)
    total, count, metrics = 0.0, None, {}
    for index, (dim, weight) in enumerate(sizes):
        loss_sum, count, term_metrics = fn(TruncatedForward(fwd, index), term_cfg, ctx)
        total = total + weight * loss_sum
        if index == 0:
            metrics.update(term_metrics)
        metrics[f"{name}_dim{dim}"] = (loss_sum.detach(), count)
    return total, count, metrics
