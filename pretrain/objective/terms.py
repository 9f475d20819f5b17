"""The loss terms: ``fn(fwd, cfg, ctx) -> (loss_sum, count, metrics)``, one per configured objective.

Each term takes what it needs from the forward cache and calls a pure loss in ``losses/``. Adding an
objective = a pure loss in ``losses/`` + a term function here + one line in ``OBJECTIVES``. RankCSE's
frozen teachers (``Teachers``) are built by the caller from loaded models: this module opens no files.
"""

from __future__ import annotations

import torch

from pretrain.distributed.comm import all_gather_with_grad
from pretrain.losses.arccon import arccon
from pretrain.losses.info_nce import info_nce
from pretrain.losses.mlm import mlm_loss
from pretrain.losses.nt_xent import nt_xent
from pretrain.losses.ranking import (
    cosine_matrix,
    js_consistency,
    listmle,
    listnet,
    mix_teacher_sims,
)
from pretrain.losses.reconstruction import frequency_weights, reconstruction_loss
from pretrain.losses.triplet import dropout_off, triplet_entailment
from pretrain.objective.forward import Context, Forward


def _prefixed(prefix: str, metrics: dict) -> dict:
    return {f"{prefix}_{k}": v for k, v in metrics.items()}


SPREAD_ROWS = 1024
"""Sentences spread_metrics looks at (a sample of the batch under objective.gradient_cache)."""


@torch.no_grad()
def spread_metrics(z_a: torch.Tensor, z_b: torch.Tensor) -> dict:
    """How far apart a term's embeddings are (this rank's rows of both views): ``emb_cos``, the mean cosine
    between different sentences (near 1 = collapsed: every input gets the same vector), and ``uniform``, the
    log of the mean exp(-2 |x - y|^2) over pairs of different sentences' unit vectors (Wang & Isola 2020; 0 =
    collapsed, lower = more spread out). Pairs of a sentence with its own other view are left out. Over the first
    SPREAD_ROWS sentences at most: the cost stays O(SPREAD_ROWS^2) when a term sees a whole cached step."""
    z_a, z_b = z_a[:SPREAD_ROWS], z_b[:SPREAD_ROWS]
    n = z_a.shape[0]
    if n < 2:
        return {}
    z = torch.nn.functional.normalize(torch.cat([z_a, z_b]).detach().float(), dim=-1)
    cos = z @ z.T
    idx = torch.arange(2 * n, device=z.device)
    other = (idx[:, None] % n) != (idx[None, :] % n)  # different sentences (not itself, not its twin view)
    pairs = 4 * n * (n - 1)  # other.sum(), known from the shape: no host sync
    # Masked by multiplication, not by boolean indexing (which needs the count on the host).
    sq_dist = (2 - 2 * cos).clamp_min(0)
    uniform = torch.log((torch.exp(-2 * sq_dist) * other).sum() / pairs)
    return {"emb_cos": ((cos * other).sum(), pairs), "uniform": (uniform, 1)}


def mlm_term(fwd: Forward, cfg, ctx: Context):
    logits, labels = fwd.mlm_logits()
    return mlm_loss(logits, labels)


def nt_xent_term(fwd: Forward, cfg, ctx: Context):
    z_a, z_b = fwd.view_projections()
    gather = None
    if cfg.gather and ctx.env.is_distributed:  # every rank's views are negatives
        def gather(rows):
            return all_gather_with_grad(rows, ctx.env), ctx.env.rank * rows.shape[0]
    loss, count, metrics = nt_xent(z_a, z_b, temperature=cfg.temperature, impl=ctx.ops.similarity,
                                   chunk_size=ctx.ops.chunk_size, gather=gather)
    return loss, count, {**metrics, **_prefixed("cl", spread_metrics(z_a, z_b))}


def info_nce_term(fwd: Forward, cfg, ctx: Context):
    """SimCSE: InfoNCE of z1 against all (gathered) z2, and all hard negatives when data.pairs has them
    (supervised SimCSE)."""
    z1, _ = fwd.pair()
    _, keys, pos = fwd.gathered_pair()
    # The positives' indices are the pair's own (``gathered_pair``): no range check, which reads them on the host.
    loss, count, metrics = info_nce(z1, keys, pos, temperature=cfg.temperature, impl=ctx.ops.similarity,
                                    chunk_size=ctx.ops.chunk_size, neg_MD=fwd.gathered_negatives(),
                                    neg_weight=cfg.hard_negative_weight, check_values=False)
    return loss, count, _prefixed("info_nce", {**metrics, **spread_metrics(*fwd.pair())})


def arccon_term(fwd: Forward, cfg, ctx: Context):
    """ArcCSE ArcCon: InfoNCE with the angular margin on the positive (hard negatives as info_nce's)."""
    z1, _ = fwd.pair()
    _, keys, pos = fwd.gathered_pair()
    loss, count, metrics = arccon(z1, keys, pos, temperature=cfg.temperature, margin_deg=cfg.margin_deg,
                                  impl=ctx.ops.similarity, chunk_size=ctx.ops.chunk_size,
                                  neg_MD=fwd.gathered_negatives(), neg_weight=cfg.hard_negative_weight,
                                  check_values=False)
    return loss, count, _prefixed("arccon", {**metrics, **spread_metrics(*fwd.pair())})


def triplet_term(fwd: Forward, cfg, ctx: Context):
    """ArcCSE triplet entailment on (s, s', s''), all three encoded in one pass with dropout off."""
    b = fwd.batch
    if "triplet_index" not in b:
        raise ValueError("objective.triplet needs triplet views in the batch; they come from the sentence stage "
                         "(data.stage=sentences data.sentences=FILE)")
    num = b["triplet_index"].numel()
    if num == 0:
        return _zero_through_head(fwd.model), 0, {}
    ids = torch.cat([b["triplet_anchor_ids"], b["triplet_low_ids"], b["triplet_high_ids"]])
    mask = torch.cat([b["triplet_anchor_mask"], b["triplet_low_mask"], b["triplet_high_mask"]])
    padded = fwd.padding_known(*(f"triplet_{part}_mask" for part in ("anchor", "low", "high")))
    with dropout_off(fwd.model):
        e = fwd.embed(fwd.model.encode(ids, mask, **padded), mask)
    loss, count, metrics = triplet_entailment(e[:num], e[num:2 * num], e[2 * num:], margin=cfg.margin)
    return loss, count, _prefixed("triplet", metrics)


def _zero_through_head(model) -> torch.Tensor:
    """0.0 tied to the sentence head's parameters (the projection's; with none, the pooler's) through the head's own
    call on no rows: each of them gets a zero gradient, as where a chunk has rows. ZeRO-3 gathers a module's
    parameters only inside its call (read from .parameters() they are empty tensors, whose [0]-shaped gradient
    fails backward). A model with neither: a plain zero (the encoder's gradients come from the other terms)."""
    cfg = model.cfg
    for head, width in ((model.projection, cfg.sentence_dim), (model.pooler, cfg.hidden_size)):
        first = next(head.parameters(), None) if head is not None else None
        if first is not None:
            return head(torch.zeros((0, width), dtype=first.dtype, device=first.device)).sum() * 0.0
    return torch.zeros((), device=model.encoder.embeddings.word.weight.device)


def consistency_term(fwd: Forward, cfg, ctx: Context):
    """RankCSE: JS divergence between the two views' similarity lists."""
    z1, z2 = fwd.pair()
    z1_all, z2_all, _ = fwd.gathered_pair()
    return js_consistency(cosine_matrix(z1, z2_all), cosine_matrix(z2, z1_all), temperature=cfg.temperature)


def rank_distill_term(fwd: Forward, cfg, ctx: Context):
    """RankCSE: ListNet / ListMLE from the frozen teachers' (mixed) similarity lists."""
    z1, _ = fwd.pair()
    _, z2_all, pos = fwd.gathered_pair()
    student = cosine_matrix(z1, z2_all)
    teacher = fwd.teachers.similarities(fwd)
    pos_idx = pos if cfg.exclude_positive else None
    if cfg.method == "listnet":
        loss, count, metrics = listnet(student, teacher, student_temperature=cfg.student_temperature,
                                       teacher_temperature=cfg.teacher_temperature, pos_idx_N=pos_idx)
    else:
        loss, count, metrics = listmle(student, teacher, temperature=cfg.student_temperature, pos_idx_N=pos_idx)
    return loss, count, _prefixed(cfg.method, metrics)


def reconstruction_term(fwd: Forward, cfg, ctx: Context):
    """SARCSE: beta * L_R (first view) + gamma * L_R+ (second view); weights applied here (SELF_WEIGHTED). The count
    (first-view sentences with content tokens) comes from the host where it counted them (training/step.py:
    host_facts' ``host_counts``, applied by ``Objective``): here it stays a device tensor, so no sync."""
    _, recon, x, mask, ids, n = fwd.autoencoded()
    weight = frequency_weights(ids, fwd.token_freq_V, cfg.theta, cfg.lam)
    known = "reconstruction" in fwd.batch.get("host_counts", {})
    l1, count, m1 = reconstruction_loss(x[:n], recon[:n], weight[:n], mask[:n], detach_target=cfg.detach_target,
                                        host_count=not known)
    l2, _, m2 = reconstruction_loss(x[n:], recon[n:], weight[n:], mask[n:], detach_target=cfg.detach_target,
                                    host_count=False)
    metrics = {"recon_mse": m1["mse"], "recon_pos_mse": m2["mse"], "recon_lr": (l1.detach(), count),
               "recon_lr_pos": (l2.detach(), count)}
    return cfg.weight * l1 + cfg.positive_weight * l2, count, metrics


OBJECTIVES = {
    "mlm": mlm_term,
    "nt_xent": nt_xent_term,
    "info_nce": info_nce_term,
    "arccon": arccon_term,
    "triplet": triplet_term,
    "consistency": consistency_term,
    "rank_distill": rank_distill_term,
    "reconstruction": reconstruction_term,
}

SELF_WEIGHTED = frozenset({"reconstruction"})
"""Terms that weight their parts themselves (two weights on one count); the composer uses 1 for them."""


# ----------------------------------------------------------------------------- teachers


class Teachers:
    """RankCSE's frozen teachers: not submodules of the trained module, run under no_grad, eval mode."""

    def __init__(self, cfg, *, models: list):
        self.cfg = cfg
        self.models = models
        self.weights = cfg.mixing_weights()
        if cfg.teacher_max_len < 2:  # [CLS] and [SEP] at least: _truncate keeps each row's [SEP] at its end
            raise ValueError(f"objective.rank_distill.teacher_max_len must be >= 2 ([CLS] and [SEP]), got "
                             f"{cfg.teacher_max_len}")
        for m in self.models:
            m.requires_grad_(False)
            m.eval()

    @torch.no_grad()
    def similarities(self, fwd: Forward) -> torch.Tensor:
        """S_T = sum_k w_k cos(t_k(x_i), t_k(x_j)'), B x M, over the same sentences and column order as the student."""
        sims = []
        for t1, t2 in fwd.teacher_embeddings():
            if fwd.gather:
                t2 = all_gather_with_grad(t2.contiguous(), fwd.ctx.env)
            sims.append(cosine_matrix(t1, t2))
        return mix_teacher_sims(sims, self.weights)

    @torch.no_grad()
    def check_student(self, vocab: int) -> None:
        """ValueError unless every teacher's vocabulary is the student's size (they read the student's token ids;
        ``TrainModule`` checks when the run is built)."""
        for path, model in zip(self.cfg.teachers or [None] * len(self.models), self.models):
            if model.cfg.vocab_size != vocab:
                raise ValueError(f"the rank_distill teacher {path or ''} has vocabulary size {model.cfg.vocab_size}, "
                                 f"the student {vocab}; teachers must share the student's tokenizer")

    def embeddings(self, fwd: Forward) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each teacher's (t1_BE, t2_BE): pooled embeddings of the pair's two sides (one sentence twice in the
        sentence stage, where both are the same: teachers run without dropout; data.pairs' anchor and positive)."""
        b = fwd.batch
        if fwd.ctx.stage == "sentences" and "positive_ids" in b:  # data.pairs: (anchor, positive)
            sides = ["sentence", "positive"]
        elif fwd.ctx.stage == "sentences":
            sides = ["sentence"]
        else:
            sides = ["view_a", "view_b"]
        self.check_student(fwd.model.cfg.vocab_size)
        out = []
        for model in self.models:
            device = b[f"{sides[0]}_ids"].device
            if next(model.parameters()).device != device:
                model.to(device)
            embs = []
            for side in sides:
                ids, mask = _truncate(b[f"{side}_ids"], b[f"{side}_mask"], self.cfg.teacher_max_len)
                # The host's record of the mask's padding holds after the cut (a full mask stays full).
                h = model.encode(ids, mask, all_layers=self.cfg.teacher_pooling == "first_last_avg",
                                 **fwd.padding_known(f"{side}_mask"))
                layers = h if isinstance(h, list) else None
                h = h[-1] if isinstance(h, list) else h
                embs.append(model.pool(h, mask, self.cfg.teacher_pooling, all_layers=layers))
            out.append((embs[0], embs[-1]))
        return out


def _truncate(ids_BT: torch.Tensor, mask_BT: torch.Tensor, max_len: int):
    """Cut rows to max_len tokens, keeping each cut row's last real token ([SEP]) at its new end."""
    if ids_BT.shape[1] <= max_len:
        return ids_BT, mask_BT
    lengths_B = mask_BT.sum(1)
    out_ids, out_mask = ids_BT[:, :max_len].clone(), mask_BT[:, :max_len]
    cut_B = lengths_B > max_len
    rows = torch.nonzero(cut_B).flatten()
    out_ids[rows, max_len - 1] = ids_BT[rows, lengths_B[rows] - 1]
    return out_ids, out_mask
