"""The Transformer encoder: embeddings, a stack of blocks, and (pre-LN only) a final LayerNorm.

Shapes: B batch, T sequence length, D hidden size, L layers, N packed tokens (unpadded, see packing.py), S of
those whose last-layer states are wanted.
"""

from __future__ import annotations

import torch
from torch import nn

from pretrain.config.model import ModelConfig
from pretrain.model.block import Block
from pretrain.model.embeddings import Embeddings
from pretrain.model.flat import forget_traced_views, materialize
from pretrain.model.packing import Packed, check_rows, keep_mask


class Encoder(nn.Module):
    """input_ids_BT, attention_mask_BT (1 = token, 0 = padding) -> h_BTD."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps) if cfg.norm == "pre" else None

    def forward(
        self, input_ids_BT: torch.Tensor, attention_mask_BT: torch.Tensor | None = None, *, all_layers: bool = False,
        token_type_ids_BT: torch.Tensor | None = None, padded: bool | None = None, packed: Packed | None = None,
        rows_S: torch.Tensor | None = None,
    ) -> torch.Tensor | list[torch.Tensor]:
        """Last hidden states h_BTD, or with ``all_layers`` the list [embeddings, layer 1, ..., layer L]
        (L+1 tensors, as HF's ``hidden_states``; for pre-LN the last one is after the final LayerNorm).
        ``padded``: whether the mask has padding, when the caller knows it from the host; None looks on the device
        (a host sync). ``packed``: the unpadded batch (its ids; the other inputs are not used) -> h_ND.
        ``rows_S``: only these tokens' states, h_SD (stream positions with ``packed``, else flat indices into
        B*T). Every layer but the last still runs on every token (each token's keys and values reach the
        others); the last computes keys, values and attention for all, and its output projection, FFN and norms for
        the S rows only: what a loss that reads S rows needs (the MLM head's labelled tokens, [CLS] pooling), as
        MosaicBERT's last layer."""
        check_rows(rows_S, all_layers)
        if packed is not None:
            if packed.longest > self.embeddings.max_tokens:
                raise ValueError(f"sequence length {packed.longest} exceeds the {self.embeddings.max_tokens} positions "
                                 f"of model.max_position={self.embeddings.position.num_embeddings}; truncate inputs "
                                 f"(data.max_len)")
            return self._layers(self.embeddings(packed.ids_N, position_ids_N=packed.position_ids_N), None, packed,
                                all_layers, rows_S)
        # The padding mask is built once and shared by every layer (packing.keep_mask).
        keep_B11T = None if attention_mask_BT is None else keep_mask(attention_mask_BT, padded)
        x_BTD = self.embeddings(input_ids_BT, token_type_ids_BT,
                                attention_mask_BT=attention_mask_BT if keep_B11T is not None else None)
        return self._layers(x_BTD, keep_B11T, None, all_layers, rows_S)

    def _layers(self, x_BTD: torch.Tensor, keep_B11T: torch.Tensor | None, packed: Packed | None,
                all_layers: bool, rows_S: torch.Tensor | None = None) -> torch.Tensor | list[torch.Tensor]:
        """The blocks (and pre-LN's final LayerNorm) over the embeddings x_BTD, or x_ND with ``packed``; the last
        block computes only ``rows_S`` when given."""
        materialize(self.layers)  # flat across the layers (train.flat_scope=encoder): their views, model/flat.py
        states = [x_BTD] if all_layers else None
        for i, layer in enumerate(self.layers):
            x_BTD = layer(x_BTD, keep_B11T, packed, rows_S if i == len(self.layers) - 1 else None)
            if all_layers:
                states.append(x_BTD)
        if self.final_norm is not None:
            x_BTD = self.final_norm(x_BTD)
            if all_layers:
                states[-1] = x_BTD
        forget_traced_views(self.layers)
        return states if all_layers else x_BTD
