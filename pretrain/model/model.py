"""PretrainModel: the encoder plus the MLM head, BERT pooler and contrastive projection.

Shapes: B batch, T sequence length, D hidden size, M masked positions, V vocabulary; unpadded (packing.py), N
packed tokens: h_ND and labels_N take the place of h_BTD and labels_BT.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.config.data import IGNORE_INDEX
from pretrain.config.model import ModelConfig
from pretrain.model.embeddings import TiedWord
from pretrain.model.encoder import Encoder
from pretrain.model.gather import gather_unique
from pretrain.model.heads import MLMHead, Pooler, ProjectionHead, SentenceDense, pool
from pretrain.model.init import init_bert_weights, init_modern_weights
from pretrain.model.modern import ModernEncoder
from pretrain.model.packing import Packed

ENCODERS = {"bert": Encoder, "modernbert": ModernEncoder}
"""model.arch -> the encoder class; both take (ids, mask | packed) and give h_BTD (h_ND)."""

# Parameters that are another parameter under a second name (state_dict lists both).
TIED_KEYS = {"mlm_head.decoder.weight": "encoder.embeddings.word.weight"}


class PretrainModel(nn.Module):
    """The encoder of model.arch (BERT or ModernBERT) with the heads the objectives need; see build_model."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        if cfg.vocab_size <= 0:
            raise ValueError(
                "model.vocab_size must be set before building the model; the trainer fills it from the "
                "tokenizer (dataclasses.replace(cfg, vocab_size=tokenizer.vocab_size))"
            )
        self.cfg = cfg
        self.encoder = ENCODERS[cfg.arch](cfg)
        self.pooler = Pooler(cfg) if cfg.pooler else None
        self.sentence_dense = SentenceDense(cfg) if cfg.dense_dim else None
        self.mlm_head = MLMHead(cfg, self.encoder.embeddings.word.weight)
        self.projection = ProjectionHead(cfg)

    def tie_weights(self) -> None:
        """(Re-)tie the MLM decoder to the word embeddings (after to_empty or load_state_dict(assign=True))."""
        self.mlm_head.decoder.weight = self.encoder.embeddings.word.weight

    @contextlib.contextmanager
    def word_rows(self):
        """Within: the word table's lookup and the MLM decoder read ``TiedWord``'s two aliases of it, so that the
        lookup's gradient comes as rows added into the decoder's (embeddings.py). Eager on the CPU only (on CUDA
        aten's dense backward is one cheap kernel and ``index_add_``'s atomics would make the sum's order vary;
        compiled code keeps its own lookup), for a table ZeRO-3 does not partition, and only when a gradient is
        recorded; otherwise a no-op. The aliases are dropped on exit (the graph keeps what its backward needs)."""
        word = self.encoder.embeddings.word
        weight_VD = word.weight
        if (weight_VD.device.type != "cpu" or torch.compiler.is_compiling() or not torch.is_grad_enabled()
                or not weight_VD.requires_grad or hasattr(weight_VD, "ds_id") or word.padding_idx is not None
                or word.max_norm is not None or word.scale_grad_by_freq or word.sparse
                or self.mlm_head.decoder.weight is not weight_VD):
            yield
            return
        word.step_weight, self.mlm_head.step_weight = TiedWord.apply(weight_VD)
        try:
            yield
        finally:
            word.step_weight = self.mlm_head.step_weight = None

    def encode(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor, *, all_layers: bool = False,
        token_type_ids_BT: torch.Tensor | None = None, padded: bool | None = None, packed: Packed | None = None,
        rows_S: torch.Tensor | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """h_BTD of the last layer, or with ``all_layers`` [embeddings, layer 1, ..., layer L]; with ``packed``
        (the unpadded batch: ids and attention groups; ids and mask are then not used) h_ND; with ``rows_S`` h_SD of
        those tokens only (stream positions, or flat indices into B*T; the last layer computes no other token's
        output).

        ``token_type_ids_BT`` (segment ids, sentence pairs) defaults to all zeros; ``padded`` as in
        ``Encoder.forward``."""
        return self.encoder(input_ids_BT, attention_mask_BT, all_layers=all_layers,
                            token_type_ids_BT=token_type_ids_BT, padded=padded, packed=packed, rows_S=rows_S)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.encoder(input_ids, attention_mask)

    def mlm_logits(self, h_BTD: torch.Tensor, labels_BT: torch.Tensor,
                   positions_M: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits_MV, labels_M) for the M positions whose label is not -100 (the head runs on those only); h_ND
        and labels_N of a packed batch work alike. ``positions_M``: those positions as flat indices into B*T (N),
        when the host already knows them; without them the boolean mask is applied on the device (M is then a
        host sync)."""
        if positions_M is None:
            keep_BT = labels_BT != IGNORE_INDEX
            return self.mlm_head(h_BTD[keep_BT]), labels_BT[keep_BT]
        h_MD = gather_unique(h_BTD.flatten(0, -2), positions_M)
        return self.mlm_head(h_MD), labels_BT.flatten().index_select(0, positions_M)

    def pool(
        self,
        h_BTD: torch.Tensor,
        attention_mask_BT: torch.Tensor | None,
        pooling: str | None = None,
        all_layers: list[torch.Tensor] | None = None,
        packed: Packed | None = None,
    ) -> torch.Tensor:
        """Sentence embeddings e_BD: pooling (default cfg.pooling, see heads.pool; h_ND with ``packed``), then the
        Dense layer and the L2 normalisation when the config has them (as sentence-transformers applies its modules
        in order)."""
        e_BD = pool(h_BTD, attention_mask_BT, pooling or self.cfg.pooling, pooler=self.pooler, all_layers=all_layers,
                    packed=packed)
        if self.sentence_dense is not None:
            e_BD = self.sentence_dense(e_BD)
        if self.cfg.normalize:
            e_BD = F.normalize(e_BD, p=2.0, dim=-1)
        return e_BD

    def project(self, e_BD: torch.Tensor) -> torch.Tensor:
        """CLEAR's projection g(e) -> z_BP."""
        return self.projection(e_BD)


def build_model(cfg: ModelConfig, *, seed: int | None = None, init: bool = True) -> PretrainModel:
    """A PretrainModel with its architecture's init (BERT's or ModernBERT's; ``seed`` gives a private generator,
    otherwise torch's default generator is used). ``init=False`` only allocates (for loading weights right after)."""
    # Built on the meta device and then allocated, so nn's own default init is not run for nothing. Allocated with
    # torch.empty rather than to_empty: empty_like of a meta tensor runs torch's Python reference kernel, whose first
    # call imports torch.fx's symbolic shapes (~0.5 s of CPU in every process that builds a model).
    with torch.device("meta"):
        model = PretrainModel(cfg)
    model._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device="cpu"))
    model.tie_weights()
    if init:
        generator = torch.Generator().manual_seed(seed) if seed is not None else None
        if cfg.arch == "modernbert":
            init_modern_weights(model, cfg.init_std, cfg.num_layers, generator=generator)
        else:
            init_bert_weights(model, cfg.init_std, generator=generator)
    return model
