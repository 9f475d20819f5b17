"""The forward cache shared by the loss terms of one micro-batch, and the terms' context.

``Forward`` computes the encoder passes lazily, so terms sharing a pass (e.g. the views) run it once.
How the embedding pair is obtained depends on the data stage (``Context.stage``): the sentence stage
encodes the same sentence twice (independent dropout), or with data.pairs the anchor and its positive (and its hard
negatives in a pass of their own); pretraining encodes CLEAR's two augmented views.
Under ``train.unpadded`` the host has packed the MLM rows and the pair (training/step.py: host_facts): the batch
carries ``packed_mlm`` and ``packed_views``/``packed_sentences`` (model/packing.py: Packed), the passes return
h_ND and pooling runs on the stream; without them every pass is the padded reference. With ``packed_joint`` too
(train.joint_pass) the MLM rows and the views share one pass (``Forward._joint_pass``).
Legend: B local rows, M = W * B gathered rows, T tokens, D hidden, P embedding dim, N packed tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from pretrain.config.train import OpsConfig
from pretrain.distributed.comm import all_gather_with_grad
from pretrain.model.autoencoder import content_tokens
from pretrain.model.packing import keep_mask, padded_stream


@dataclass
class Context:
    env: object
    """DistEnv: rank/world for gathering negatives and reducing counts."""
    ops: OpsConfig
    pooling: str
    stage: Literal["pretrain", "sentences"] = "pretrain"
    """data.stage: which batch keys hold the embedding pair (CLEAR views, or one sentence twice)."""
    view_mean_mix: float | torch.Tensor | None = None
    """Weight (> 0) of mean pooling blended into ``pooling`` for CLEAR's views (objective.nt_xent.
    mean_pool_warmup_steps; the trainer sets it each step, see mean_pool_mix; a 0-dim tensor under the compiled
    step, ``TrainModule.set_view_mean_mix``). None: no blend, what a weight of 0 is kept as, so that the step
    does not depend on a float that is not used."""
    matryoshka_dims: tuple[int, ...] = ()
    """objective.matryoshka's sizes, largest first (set by Objective): the pair's, views' and hard negatives'
    embeddings are then one block per size, side by side (``embed(nested=True)``); () = off."""
    trim_last_layer: bool = False
    """train.trim_last_layer: the MLM and pair passes compute their last layer only where a loss reads it (the MLM
    rows' labelled tokens; the pair's [CLS] when it is pooled so and nothing else reads its tokens)."""
    joint_pass: bool = False
    """train.joint_pass: the MLM rows and CLEAR's views through one encoder pass when the host packed them together
    (``packed_joint``). ``Objective`` keeps it only where one pass serves both: an MLM term beside a term of the
    views, in pretraining."""

    def __setattr__(self, name, value):
        if name == "view_mean_mix" and isinstance(value, (int, float)) and not value > 0.0:
            value = None  # no blend: see the field
        super().__setattr__(name, value)


def mean_pool_mix(step: int, warmup_steps: int) -> float:
    """The weight of mean pooling in the views' embedding at ``step`` (steps done): 1 - step/K while step < K."""
    return max(0.0, 1.0 - step / warmup_steps) if warmup_steps > 0 else 0.0


class Forward:
    """Lazily computed forward passes of one micro-batch, shared by the loss terms."""

    def __init__(self, model, batch: dict, ctx: Context, *, heads=None, gather: bool = False,
                 teachers=None, token_freq_V: torch.Tensor | None = None, cached: dict | None = None):
        self.model, self.batch, self.ctx = model, batch, ctx
        self.heads = heads if heads is not None else {}
        self.teachers, self.token_freq_V = teachers, token_freq_V
        self.gather = gather and ctx.env.is_distributed
        """Gather the pair's keys from all ranks (the info_nce/arccon setting, shared by the RankCSE terms)."""
        self._cache: dict = dict(cached or {})
        """Passes by name; ``cached`` presets some (the gradient cache's whole-step ``views``, ``pair``, ``teacher``)."""

    def mlm_hidden(self) -> torch.Tensor:
        """h_BTD of the MLM rows, h_ND when the host packed them, or h_MD of their labelled tokens only when the
        last layer is trimmed (``_mlm_trimmed``)."""
        if "mlm" not in self._cache and self._joint():
            self._joint_pass()
        if "mlm" not in self._cache:
            packed = self.batch.get("packed_mlm")
            rows = _known(rows_S=self.batch["mlm_positions"] if self._mlm_trimmed() else None)
            if packed is not None:
                self._cache["mlm"] = self.model.encode(None, None, packed=packed, **rows)
            else:
                self._cache["mlm"] = self.model.encode(self.batch["input_ids"], self.batch["attention_mask"],
                                                       **self.padding_known("attention_mask"), **rows)
        return self._cache["mlm"]

    def _mlm_trimmed(self) -> bool:
        """Whether the MLM pass computes its last layer for the labelled tokens only: train.trim_last_layer and the
        host's positions of them (flat indices into the stream, or into B*T when padded)."""
        return self.ctx.trim_last_layer and "mlm_positions" in self.batch

    def mlm_logits(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits_MV, labels_M): the MLM head on the M labelled tokens of the MLM rows, and their labels."""
        labels = self.batch["mlm_labels_packed"] if "packed_mlm" in self.batch else self.batch["mlm_labels"]
        if self._mlm_trimmed():
            labels_M = labels.flatten().index_select(0, self.batch["mlm_positions"])
            return self.model.mlm_head(self.mlm_hidden()), labels_M
        return self.model.mlm_logits(self.mlm_hidden(), labels, self.batch.get("mlm_positions"))

    def _padded(self, mask_key: str) -> bool | None:
        """Whether the batch's ``mask_key`` has padding, as the host recorded it (training/step.py: host_facts);
        None when it did not (the encoder then looks on the device)."""
        if torch.compiler.is_compiling():
            # The compiled step applies every mask (the encoder's choice when this is None): a set of full masks
            # read here would be a guard, and each new combination of them a recompile.
            return None
        full = self.batch.get("full_masks")
        return None if full is None else mask_key not in full

    def padding_known(self, *mask_keys: str) -> dict:
        """``encode``'s ``padded`` keyword for a padded pass over these masks stacked: whether any has padding, as
        the host recorded them (``_padded``); {} where it did not record one (the encoder then looks on the
        device, a host sync)."""
        padded = [self._padded(key) for key in mask_keys]
        return {} if None in padded else {"padded": any(padded)}

    def embed(self, h_BTD: torch.Tensor, mask_BT: torch.Tensor | None, mean_mix: float | None = None,
              packed=None, *, nested: bool = False) -> torch.Tensor:
        """Training-time sentence embedding: pool (blended with ``mean_mix`` of mean pooling) -> projection MLP.
        With ``packed`` (Packed), h is h_ND of an unpadded pass. ``nested`` under objective.matryoshka: z_B(KP), the
        projection of e's first d coordinates (the rest zeroed) for each of the K sizes d, side by side."""
        rows = _known(packed=packed)
        e_BD = self.model.pool(h_BTD, mask_BT, self.ctx.pooling, **rows)
        if mean_mix is not None and self.ctx.pooling != "mean":
            e_BD = (1.0 - mean_mix) * e_BD + mean_mix * self.model.pool(h_BTD, mask_BT, "mean", **rows)
        if nested and self.ctx.matryoshka_dims:
            return torch.cat([self.model.projection(first_coordinates(e_BD, d)) for d in self.ctx.matryoshka_dims],
                             dim=-1)
        return self.model.projection(e_BD)

    def _pair_inputs(self) -> tuple[torch.Tensor, torch.Tensor, int, bool | None, object]:
        """(ids_2BT, mask_2BT, B, padded, packed): the pair's halves stacked as one padded batch (``padded`` as the
        host recorded it, see ``_padded``) and their Packed stream when the host packed them (else None)."""
        b = self.batch
        if self.ctx.stage == "sentences" and "positive_ids" not in b:  # one sentence twice, independent dropout
            ids = torch.cat([b["sentence_ids"], b["sentence_ids"]])
            mask = torch.cat([b["sentence_mask"], b["sentence_mask"]])
            return ids, mask, b["sentence_ids"].shape[0], self._padded("sentence_mask"), b.get("packed_sentences")
        # two sentences: CLEAR's two augmented views, or data.pairs' (anchor, positive)
        first, second = ("sentence", "positive") if self.ctx.stage == "sentences" else ("view_a", "view_b")
        ids, mask = _stack_padded([b[f"{first}_ids"], b[f"{second}_ids"]], [b[f"{first}_mask"], b[f"{second}_mask"]])
        a, z = self._padded(f"{first}_mask"), self._padded(f"{second}_mask")
        same_len = b[f"{first}_ids"].shape[1] == b[f"{second}_ids"].shape[1]
        padded = None if a is None or z is None else (a or z or not same_len)
        packed = b.get("packed_sentences" if self.ctx.stage == "sentences" else "packed_views")
        return ids, mask, b[f"{first}_ids"].shape[0], padded, packed

    def _pair_pass(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int, object]:
        """(h, mask_2BT, ids_2BT, B, packed): both halves of the pair through one encoder pass; h is h_2BTD, or
        h_ND when the host packed the pair (``packed`` is then its Packed, else None)."""
        if "pair_h" not in self._cache and self._joint():
            self._joint_pass()
        if "pair_h" not in self._cache:
            ids, mask, n, padded, packed = self._pair_inputs()
            if self._pair_trimmed():  # h_2B1D, pooled as a padded pass's first column
                h, mask, packed = self._cls_states(ids, mask, _known(padded=padded), packed), None, None
            elif packed is not None:
                h = self.model.encode(None, None, packed=packed)
            else:
                h = self.model.encode(ids, mask, **_known(padded=padded))
            self._cache["pair_h"] = (h, mask, ids, n, packed)
        return self._cache["pair_h"]

    def _joint(self) -> bool:
        """Whether the MLM rows and the views go through one pass (``_joint_pass``, which caches both): train.joint_pass
        kept by the objective, and either the host's joint stream in the batch or neither packed (the padded path)."""
        b = self.batch
        return self.ctx.joint_pass and ("packed_joint" in b or (
            "packed_mlm" not in b and "packed_views" not in b and "input_ids" in b and "view_a_ids" in b))

    def _joint_pass(self) -> None:
        """The MLM rows and CLEAR's views through one encoder pass, its result split into the two passes' cache
        entries, each as its own pass would have returned it. Unpadded, the stream is the host's ``packed_joint``
        (the MLM rows' stream, then the views', as ``packed_mlm`` and ``packed_views`` hold them); padded (also
        the compiled step's with static or bucketed shapes), ``packing.padded_stream`` of the two padded batches,
        pads included, each attended to at its own width. Every layer then runs once per micro-batch instead of
        twice: half the kernel launches (and, under ZeRO-3, half the parameter gathers), larger matrix products;
        sequences still attend only to themselves. A trimmed last layer (train.trim_last_layer) computes the union
        of the rows the two would keep."""
        b = self.batch
        ids, mask, n, padded, views = self._pair_inputs()
        mlm_trimmed, pair_trimmed = self._mlm_trimmed(), self._pair_trimmed()
        unpadded = "packed_joint" in b
        if unpadded:
            stream, sizes = b["packed_joint"], [b["packed_mlm"].num_tokens, views.num_tokens]
            pair_rows = views.first_B if pair_trimmed else None
        else:
            ids_m = b["input_ids"]
            stream = padded_stream([(ids_m, keep_mask(b["attention_mask"], self._padded("attention_mask"))),
                                    (ids, keep_mask(mask, padded))])
            sizes, views = [ids_m.numel(), ids.numel()], None
            pair_rows = _first_tokens(ids) if pair_trimmed else None
        mlm_rows = b["mlm_positions"] if mlm_trimmed else None
        rows_S = None
        if mlm_rows is not None or pair_rows is not None:
            device = ids.device
            mlm_rows = torch.arange(sizes[0], device=device) if mlm_rows is None else mlm_rows
            pair_rows = torch.arange(sizes[1], device=device) if pair_rows is None else pair_rows
            rows_S, sizes = torch.cat([mlm_rows, pair_rows + sizes[0]]), [mlm_rows.shape[0], pair_rows.shape[0]]
        h_mlm, h_pair = self.model.encode(None, None, packed=stream, rows_S=rows_S).split(sizes)
        if not unpadded:  # each pass's tokens back to its batch's (rows, width), unless trimmed to rows
            h_mlm = h_mlm if mlm_trimmed else h_mlm.view(*b["input_ids"].shape, -1)
            h_pair = h_pair if pair_trimmed else h_pair.view(*ids.shape, -1)
        self._cache["mlm"] = h_mlm
        if pair_trimmed:  # h_2B1D, as _cls_states returns it
            self._cache["pair_h"] = (h_pair[:, None], None, ids, n, None)
        else:
            self._cache["pair_h"] = (h_pair, mask, ids, n, views)

    def _cls_states(self, ids_BT, mask_BT, padded: dict, packed=None) -> torch.Tensor:
        """h_B1D: each row's [CLS] state, the last layer run for those tokens only (train.trim_last_layer)."""
        if packed is not None:
            return self.model.encode(None, None, packed=packed, rows_S=packed.first_B)[:, None]
        return self.model.encode(ids_BT, mask_BT, **padded, rows_S=_first_tokens(ids_BT))[:, None]

    def _pair_trimmed(self) -> bool:
        """Whether the pair's pass needs its [CLS] states only: train.trim_last_layer, [CLS] pooling, no mean pooling
        blended in (CLEAR's views early on) and no autoencoder reading every token."""
        mixed = self.ctx.stage != "sentences" and self.ctx.view_mean_mix is not None
        return (self.ctx.trim_last_layer and self.ctx.pooling in ("cls", "cls_before_pooler") and not mixed
                and "autoencoder" not in self.heads)

    def pair_hidden(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(h_2BTD, mask_2BT, ids_2BT, B): the pair's pass in the padded layout (an unpadded pass is unpacked, zeros
        on padding: SARCSE's autoencoder convolves over rows)."""
        h, mask, ids, n, packed = self._pair_pass()
        if mask is None:
            raise RuntimeError("the pair's pass kept only its [CLS] states (train.trim_last_layer); nothing that "
                               "reads every token may use it")
        return (packed.unpack(h) if packed is not None else h), mask, ids, n

    def _pair_embeddings(self, mean_mix: float | None = None) -> torch.Tensor:
        """z_2BP: ``embed`` of the pair's pass, padded or packed."""
        h, mask, _, _, packed = self._pair_pass()
        return self.embed(h, None if packed is not None else mask, mean_mix, packed=packed, nested=True)

    def view_projections(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(z_a, z_b): both views through one encoder pass (padded together, or packed), pooled, projected."""
        if "views" not in self._cache:
            if self.ctx.stage == "sentences":
                raise ValueError("objective.nt_xent needs CLEAR views (data.stage=pretrain); the sentence stage "
                                 "has none: use info_nce or arccon there")
            n = self._pair_pass()[3]
            z = self._pair_embeddings(self.ctx.view_mean_mix)
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
            elif self.ctx.stage == "sentences":
                n = self._pair_pass()[3]
                z = self._pair_embeddings()
                self._cache["pair"] = (z[:n], z[n:])
            else:
                self._cache["pair"] = self.view_projections()
        return self._cache["pair"]

    def hard_negatives(self) -> torch.Tensor | None:
        """z3_BP: data.pairs' hard negatives (batch ``negative_ids``), embedded as the pair is (pool -> projection,
        or the autoencoder's Z; the last layer trimmed to [CLS] as the pair's) in a pass of their own, padded; None
        when the batch has none."""
        if "negative" not in self._cache:
            b = self.batch
            z = None
            if "negative_ids" in b:
                ids, mask = b["negative_ids"], b["negative_mask"]
                padded = self.padding_known("negative_mask")
                if self._pair_trimmed():  # pooled as the pair is: each row's [CLS] only
                    z = self.embed(self._cls_states(ids, mask, padded), None, nested=True)
                elif "autoencoder" in self.heads:
                    h = self.model.encode(ids, mask, **padded)
                    x, content_mask, _ = _content_tokens(h, mask, ids)
                    z = self.heads["autoencoder"](x, content_mask)[0]
                else:
                    z = self.embed(self.model.encode(ids, mask, **padded), mask, nested=True)
            self._cache["negative"] = z
        return self._cache["negative"]

    def gathered_negatives(self) -> torch.Tensor | None:
        """neg_MP: every rank's hard negatives (with gradient, in the keys' row order when gathering), or None."""
        if "gathered_negative" not in self._cache:
            z3 = self.hard_negatives()
            if z3 is not None and self.gather:
                z3 = all_gather_with_grad(z3, self.ctx.env)
            self._cache["gathered_negative"] = z3
        return self._cache["gathered_negative"]

    def teacher_embeddings(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """RankCSE: each teacher's (t1_BE, t2_BE) of the pair's sentences (no gradient)."""
        if "teacher" not in self._cache:
            self._cache["teacher"] = self.teachers.embeddings(self)
        return self._cache["teacher"]

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


class TruncatedForward:
    """Block ``index`` of ``parent``'s nested embeddings (objective.matryoshka): what a contrastive term reads, at one
    size. Everything else (batch, model, teachers, context) is the parent's."""

    def __init__(self, parent: Forward, index: int):
        self.parent, self.index = parent, index
        self.model, self.batch, self.ctx = parent.model, parent.batch, parent.ctx
        self.heads, self.teachers, self.gather = parent.heads, parent.teachers, parent.gather

    def _block(self, z: torch.Tensor | None) -> torch.Tensor | None:
        if z is None:
            return None
        width = z.shape[-1] // len(self.ctx.matryoshka_dims)
        return z[..., self.index * width:(self.index + 1) * width]

    def view_projections(self):
        return tuple(self._block(z) for z in self.parent.view_projections())

    def pair(self):
        return tuple(self._block(z) for z in self.parent.pair())

    def gathered_pair(self):
        z1, z2, pos = self.parent.gathered_pair()
        return self._block(z1), self._block(z2), pos

    def hard_negatives(self):
        return self._block(self.parent.hard_negatives())

    def gathered_negatives(self):
        return self._block(self.parent.gathered_negatives())

    def teacher_embeddings(self):
        return self.parent.teacher_embeddings()


def first_coordinates(e_BD: torch.Tensor, dim: int) -> torch.Tensor:
    """e with coordinates dim.. zeroed: what the projection sees of e truncated to its first ``dim``."""
    if dim > e_BD.shape[-1]:
        raise ValueError(f"objective.matryoshka.dims has {dim}, larger than the sentence embedding ({e_BD.shape[-1]})")
    keep_D = torch.arange(e_BD.shape[-1], device=e_BD.device) < dim
    return e_BD * keep_D.to(e_BD.dtype)


def _stack_padded(ids_list, mask_list):
    t = max(x.shape[1] for x in ids_list)
    ids = torch.cat([torch.nn.functional.pad(x, (0, t - x.shape[1])) for x in ids_list])
    mask = torch.cat([torch.nn.functional.pad(m, (0, t - m.shape[1])) for m in mask_list])
    return ids, mask


def _content_tokens(h_BTD, mask_BT, ids_BT):
    """Drop [CLS] (position 0) and [SEP] (last real token) -> (x_B(T-2)D, mask, ids), SARCSE sec. 2.1."""
    return content_tokens(h_BTD, mask_BT, ids_BT)


def _first_tokens(ids_BT: torch.Tensor) -> torch.Tensor:
    """first_B: each row's first token as a flat index into B*T (a padded pass's [CLS] rows, ``rows_S``)."""
    return torch.arange(ids_BT.shape[0], device=ids_BT.device) * ids_BT.shape[1]


def _known(**kwargs) -> dict:
    """The keyword arguments whose value is known (not None): models that do not take them still work."""
    return {k: v for k, v in kwargs.items() if v is not None}
