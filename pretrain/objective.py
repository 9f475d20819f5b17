"""Combines the configured loss terms with their weights.

Each term is ``fn(fwd, cfg, ctx) -> (loss_sum, count, metrics)``; ``fwd`` computes the
forward passes lazily so terms sharing a pass (e.g. the views) run it once. Adding an
objective = a pure loss in ``objectives/`` + a term function + one line in ``OBJECTIVES``.

Normalisation (DESIGN.md): every term's ``loss_sum`` is divided by its count summed over
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

from dataclasses import dataclass

import torch

from pretrain.config.data import DataConfig
from pretrain.config.objective import ObjectiveConfig
from pretrain.config.train import OpsConfig
from pretrain.distributed.comm import all_gather_with_grad
from pretrain.objectives.arccon import arccon
from pretrain.objectives.info_nce import info_nce
from pretrain.objectives.mlm import mlm_loss
from pretrain.objectives.nt_xent import nt_xent
from pretrain.objectives.ranking import cosine_matrix, js_consistency, listmle, listnet, mix_teacher_sims
from pretrain.objectives.reconstruction import frequency_weights, load_token_freq, reconstruction_loss
from pretrain.objectives.triplet import dropout_off, triplet_entailment


@dataclass
class Context:
    env: object
    """DistEnv: rank/world for gathering negatives and reducing counts."""
    ops: OpsConfig
    pooling: str
    data: DataConfig | None = None
    """Where SARCSE's token frequencies come from when objective.reconstruction.token_freq is empty."""
    tokenizer: object = None


class Forward:
    """Lazily computed forward passes of one micro-batch, shared by the loss terms."""

    def __init__(self, model, batch: dict, ctx: Context, *, heads=None, gather: bool = False,
                 teachers: Teachers | None = None, token_freq_V: torch.Tensor | None = None):
        self.model, self.batch, self.ctx = model, batch, ctx
        self.heads = heads if heads is not None else {}
        self.teachers, self.token_freq_V = teachers, token_freq_V
        self.gather = gather and ctx.env.is_distributed
        """Gather the pair's keys from all ranks (the info_nce/arccon setting, shared by the RankCSE terms)."""
        self._cache: dict = {}

    def mlm_hidden(self) -> torch.Tensor:
        if "mlm" not in self._cache:
            self._cache["mlm"] = self.model.encode(self.batch["input_ids"], self.batch["attention_mask"])
        return self._cache["mlm"]

    def embed(self, h_BTD: torch.Tensor, mask_BT: torch.Tensor) -> torch.Tensor:
        """Training-time sentence embedding: pool -> projection MLP."""
        return self.model.projection(self.model.pool(h_BTD, mask_BT, self.ctx.pooling))

    def pair_hidden(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(h_2BTD, mask_2BT, ids_2BT, B): both halves of the pair through one encoder pass."""
        if "pair_h" not in self._cache:
            b = self.batch
            if "sentence_ids" in b:  # sentence stage: the same sentence twice, independent dropout
                ids = torch.cat([b["sentence_ids"], b["sentence_ids"]])
                mask = torch.cat([b["sentence_mask"], b["sentence_mask"]])
                n = b["sentence_ids"].shape[0]
            else:  # pretraining: CLEAR's two augmented views
                ids, mask = _stack_padded([b["view_a_ids"], b["view_b_ids"]], [b["view_a_mask"], b["view_b_mask"]])
                n = b["view_a_ids"].shape[0]
            self._cache["pair_h"] = (self.model.encode(ids, mask), mask, ids, n)
        return self._cache["pair_h"]

    def view_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(z_a, z_b): both views through one encoder pass (padded together), pooled, projected."""
        if "views" not in self._cache:
            if "sentence_ids" in self.batch:
                raise ValueError("objective.nt_xent needs CLEAR views (data.stage=pretrain); the sentence stage "
                                 "has none: use info_nce or arccon there")
            h, mask, _, n = self.pair_hidden()
            z = self.embed(h, mask)
            self._cache["views"] = (z[:n], z[n:])
        return self._cache["views"]

    def autoencoded(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """SARCSE: (z_2BE, recon_2BTD, x_2BTD, mask_2BT, ids_2BT, B) over the content tokens of the pair."""
        if "ae" not in self._cache:
            h, mask, ids, n = self.pair_hidden()
            x, content_mask, content_ids = _content_tokens(h, mask, ids)
            z, recon = self.heads["autoencoder"](x, content_mask)
            self._cache["ae"] = (z, recon, x, content_mask, content_ids, n)
        return self._cache["ae"]

    def pair(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(z1_BP, z2_BP): the two halves' embeddings (the AE's Z when reconstruction is on)."""
        if "pair" not in self._cache:
            if "autoencoder" in self.heads:
                z, *_, n = self.autoencoded()
                self._cache["pair"] = (z[:n], z[n:])
            elif "sentence_ids" in self.batch:
                h, mask, _, n = self.pair_hidden()
                z = self.embed(h, mask)
                self._cache["pair"] = (z[:n], z[n:])
            else:
                self._cache["pair"] = self.view_projections()
        return self._cache["pair"]

    def gathered_pair(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(z1_MP, z2_MP, pos_idx_B): all ranks' embeddings (with gradient) and each local row's positive."""
        if "gathered" not in self._cache:
            z1, z2 = self.pair()
            offset = 0
            if self.gather:
                z1, z2 = all_gather_with_grad(z1, self.ctx.env), all_gather_with_grad(z2, self.ctx.env)
                offset = self.ctx.env.rank * self.pair()[0].shape[0]
            pos = torch.arange(self.pair()[0].shape[0], device=z1.device) + offset
            self._cache["gathered"] = (z1, z2, pos)
        return self._cache["gathered"]


def _stack_padded(ids_list, mask_list):
    t = max(x.shape[1] for x in ids_list)
    ids = torch.cat([torch.nn.functional.pad(x, (0, t - x.shape[1])) for x in ids_list])
    mask = torch.cat([torch.nn.functional.pad(m, (0, t - m.shape[1])) for m in mask_list])
    return ids, mask


def _content_tokens(h_BTD, mask_BT, ids_BT):
    """Drop [CLS] (position 0) and [SEP] (last real token) -> (x_B(T-2)D, mask, ids), SARCSE sec. 2.1."""
    from pretrain.model.autoencoder import content_tokens

    return content_tokens(h_BTD, mask_BT, ids_BT)


def _prefixed(prefix: str, metrics: dict) -> dict:
    return {f"{prefix}_{k}": v for k, v in metrics.items()}


# ----------------------------------------------------------------------------- terms


def mlm_term(fwd: Forward, cfg, ctx: Context):
    logits, labels = fwd.model.mlm_logits(fwd.mlm_hidden(), fwd.batch["mlm_labels"])
    return mlm_loss(logits, labels)


def nt_xent_term(fwd: Forward, cfg, ctx: Context):
    z_a, z_b = fwd.view_projections()
    gather = ctx.env if (cfg.gather and ctx.env.is_distributed) else None
    return nt_xent(z_a, z_b, temperature=cfg.temperature, impl=ctx.ops.similarity,
                   chunk_size=ctx.ops.chunk_size, gather_env=gather)


def info_nce_term(fwd: Forward, cfg, ctx: Context):
    """SimCSE: InfoNCE of z1 against all (gathered) z2."""
    z1, _ = fwd.pair()
    _, keys, pos = fwd.gathered_pair()
    loss, count, metrics = info_nce(z1, keys, pos, temperature=cfg.temperature, impl=ctx.ops.similarity,
                                    chunk_size=ctx.ops.chunk_size)
    return loss, count, _prefixed("info_nce", metrics)


def arccon_term(fwd: Forward, cfg, ctx: Context):
    """ArcCSE ArcCon: InfoNCE with the angular margin on the positive."""
    z1, _ = fwd.pair()
    _, keys, pos = fwd.gathered_pair()
    loss, count, metrics = arccon(z1, keys, pos, temperature=cfg.temperature, margin_deg=cfg.margin_deg,
                                  impl=ctx.ops.similarity, chunk_size=ctx.ops.chunk_size)
    return loss, count, _prefixed("arccon", metrics)


def triplet_term(fwd: Forward, cfg, ctx: Context):
    """ArcCSE triplet entailment on (s, s', s''), all three encoded in one pass with dropout off."""
    b = fwd.batch
    if "triplet_index" not in b:
        raise ValueError("objective.triplet needs triplet views in the batch; they come from the sentence stage "
                         "(data.stage=sentences data.sentences=FILE)")
    num = b["triplet_index"].numel()
    if num == 0:
        zero = sum(p.sum() for p in fwd.model.projection.parameters()) * 0.0
        return zero, 0, {}
    ids = torch.cat([b["triplet_anchor_ids"], b["triplet_low_ids"], b["triplet_high_ids"]])
    mask = torch.cat([b["triplet_anchor_mask"], b["triplet_low_mask"], b["triplet_high_mask"]])
    with dropout_off(fwd.model):
        e = fwd.embed(fwd.model.encode(ids, mask), mask)
    loss, count, metrics = triplet_entailment(e[:num], e[num:2 * num], e[2 * num:], margin=cfg.margin)
    return loss, count, _prefixed("triplet", metrics)


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
    """SARCSE: beta * L_R (first view) + gamma * L_R+ (second view); weights applied here (SELF_WEIGHTED)."""
    _, recon, x, mask, ids, n = fwd.autoencoded()
    weight = frequency_weights(ids, fwd.token_freq_V, cfg.theta, cfg.lam)
    l1, count, m1 = reconstruction_loss(x[:n], recon[:n], weight[:n], mask[:n], detach_target=cfg.detach_target)
    l2, _, m2 = reconstruction_loss(x[n:], recon[n:], weight[n:], mask[n:], detach_target=cfg.detach_target)
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

    def __init__(self, cfg, *, models: list | None = None):
        self.cfg = cfg
        self.models = models if models is not None else [load_teacher(p) for p in cfg.teachers]
        self.weights = cfg.mixing_weights()
        for m in self.models:
            m.requires_grad_(False)
            m.eval()

    @torch.no_grad()
    def similarities(self, fwd: Forward) -> torch.Tensor:
        """S_T = sum_k w_k cos(t_k(x_i), t_k(x_j)'), B x M, over the same sentences and column order as the student."""
        b = fwd.batch
        if "sentence_ids" in b:
            sides = [(b["sentence_ids"], b["sentence_mask"])]
        else:
            sides = [(b["view_a_ids"], b["view_a_mask"]), (b["view_b_ids"], b["view_b_mask"])]
        vocab = fwd.model.cfg.vocab_size
        sims = []
        for model in self.models:
            if model.cfg.vocab_size != vocab:
                raise ValueError(f"a rank_distill teacher has vocabulary size {model.cfg.vocab_size}, the student "
                                 f"{vocab}; teachers must share the student's tokenizer")
            device = sides[0][0].device
            if next(model.parameters()).device != device:
                model.to(device)
            embs = []
            for ids, mask in sides:
                ids, mask = _truncate(ids, mask, self.cfg.teacher_max_len)
                h = model.encode(ids, mask, all_layers=self.cfg.teacher_pooling == "first_last_avg")
                layers = h if isinstance(h, list) else None
                h = h[-1] if isinstance(h, list) else h
                embs.append(model.pool(h, mask, self.cfg.teacher_pooling, all_layers=layers))
            t1, t2 = embs[0], embs[-1]
            if fwd.gather:
                t2 = all_gather_with_grad(t2.contiguous(), fwd.ctx.env)
            sims.append(cosine_matrix(t1, t2))
        return mix_teacher_sims(sims, self.weights)


def load_teacher(path: str):
    """A frozen teacher PretrainModel from our checkpoint, a from-hf init dir or a HF BERT dir."""
    from pathlib import Path

    if not Path(path).exists():
        raise FileNotFoundError(f"objective.rank_distill teacher {path} does not exist; give one of our checkpoints, "
                                "a pretrain-convert from-hf directory or a HF BERT directory")
    if (Path(path) / "config.json").is_file():  # a HF BERT directory
        from pretrain.checkpoint.hf import load_hf_model

        return load_hf_model(path)
    from pretrain.checkpoint.convert import load_checkpoint_model  # our checkpoint or init dir; no tokenizer needed

    return load_checkpoint_model(path)[0]


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


# ----------------------------------------------------------------------------- composer


class Objective:
    """Runs the enabled terms on a micro-batch -> (loss for backward, raw sums for metrics)."""

    def __init__(self, cfg: ObjectiveConfig, ctx: Context, *, teachers: Teachers | None = None,
                 token_freq_V: torch.Tensor | None = None):
        self.cfg, self.ctx = cfg, ctx
        self.terms = []
        for name in cfg.enabled():
            if name not in OBJECTIVES:
                raise ValueError(f"objective.{name} is configured but no loss term implements it; "
                                 f"available: {', '.join(OBJECTIVES)}")
            self.terms.append((name, OBJECTIVES[name], getattr(cfg, name)))
        pair_cfg = cfg.info_nce or cfg.arccon
        self.gather = bool(pair_cfg is not None and pair_cfg.gather)
        self.teachers = teachers
        if cfg.rank_distill is not None and teachers is None:
            self.teachers = Teachers(cfg.rank_distill)
        self.token_freq_V = token_freq_V
        if cfg.reconstruction is not None and token_freq_V is None:
            self.token_freq_V = resolve_token_freq(cfg, ctx)

    def build_heads(self, model) -> torch.nn.ModuleDict:
        """Trainable modules the terms add on top of the model (SARCSE's autoencoder); empty otherwise."""
        heads = torch.nn.ModuleDict()
        rc = self.cfg.reconstruction
        if rc is not None:
            from pretrain.model.autoencoder import TextCNNAutoencoder

            heads["autoencoder"] = TextCNNAutoencoder(model.cfg.hidden_size, tuple(rc.kernel_sizes), rc.channels,
                                                      rc.integrate_channels)
        return heads

    def __call__(self, model, batch: dict, heads=None):
        fwd = Forward(model, batch, self.ctx, heads=heads, gather=self.gather, teachers=self.teachers,
                      token_freq_V=self.token_freq_V)
        sums, counts, metrics = {}, {}, {}
        for name, fn, term_cfg in self.terms:
            loss_sum, count, term_metrics = fn(fwd, term_cfg, self.ctx)
            sums[name], counts[name] = loss_sum, count
            metrics.update(term_metrics)
        global_counts = _reduce_counts([counts[n] for n, _, _ in self.terms], self.ctx.env)
        world = self.ctx.env.world_size
        loss = 0.0
        for (name, _, term_cfg), total in zip(self.terms, global_counts):
            weight = 1.0 if name in SELF_WEIGHTED else term_cfg.weight
            if total > 0:
                loss = loss + weight * sums[name] * (world / total)
            metrics[name] = (sums[name].detach().item(), counts[name])
        if not torch.is_tensor(loss):
            loss = sum(s for s in sums.values()) * 0.0
        return loss, metrics


def resolve_token_freq(cfg: ObjectiveConfig, ctx: Context) -> torch.Tensor:
    """SARCSE's freq(w): objective.reconstruction.token_freq, else the training data's frequencies."""
    rc = cfg.reconstruction
    if rc.token_freq:
        return load_token_freq(rc.token_freq)
    data = ctx.data
    if data is not None and data.stage == "sentences":
        from pretrain.data.sentences import build_sentence_dataset

        if ctx.tokenizer is None:
            raise ValueError("the sentence stage's token frequencies need the tokenizer in the objective Context")
        return torch.from_numpy(build_sentence_dataset(data, cfg, ctx.tokenizer, seed=0).token_frequencies())
    if data is not None and data.sources:
        return load_token_freq(data.sources[0].path)
    raise ValueError("objective.reconstruction needs token frequencies: set objective.reconstruction.token_freq "
                     "to a token_freq.npy (pretrain-preprocess writes one) or configure data.sources/data.sentences")


def _reduce_counts(counts: list, env) -> list[float]:
    if not env.is_distributed:
        return [float(c) for c in counts]
    from pretrain.distributed.comm import all_reduce_host

    return all_reduce_host(torch.tensor(counts, dtype=torch.float64)).tolist()


class TrainModule(torch.nn.Module):
    """What DeepSpeed wraps: the model (saved as ``model.*``), the objective's trainable heads
    (``heads.*``, e.g. SARCSE's autoencoder) and the objective (teachers stay outside: not parameters)."""

    def __init__(self, model: torch.nn.Module, objective: Objective):
        super().__init__()
        self.model = model
        self.heads = objective.build_heads(model) if hasattr(objective, "build_heads") else torch.nn.ModuleDict()
        self.objective = objective

    def forward(self, batch: dict):
        return self.objective(self.model, batch, self.heads)
