"""Token + learned absolute position (+ BERT token-type 0) embeddings, LayerNorm, dropout.

Shapes: B batch, T sequence length, D hidden size, V vocabulary; unpadded, ids_N of N packed tokens with their
position_ids_N (packing.py) take ids_BT's place.
"""

from __future__ import annotations

import torch
from torch import nn

from pretrain.config.model import ModelConfig


class Embeddings(nn.Module):
    """ids_BT -> x_BTD = LayerNorm(word[ids] + position[0..T) + token_type[types or 0]), then dropout."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.max_position, cfg.hidden_size)
        # BERT's segment embeddings: pretraining uses type 0 only; sentence-pair fine-tuning (GLUE) passes
        # token_type_ids_BT with 1 on the second segment, as BERT does.
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, input_ids_BT: torch.Tensor, token_type_ids_BT: torch.Tensor | None = None,
                position_ids_N: torch.Tensor | None = None) -> torch.Tensor:
        """x_BTD, or x_ND for packed ids_N with ``position_ids_N`` (each sequence's positions restart at 0; the
        caller checks them against max_position on the host)."""
        if position_ids_N is not None:
            types = self.token_type.weight[0] if token_type_ids_BT is None else self.token_type(token_type_ids_BT)
            x_ND = self.word(input_ids_BT) + types
            return self.dropout(self.norm(x_ND + self.position(position_ids_N)))
        num_tokens = input_ids_BT.shape[1]
        if num_tokens > self.position.num_embeddings:
            raise ValueError(
                f"sequence length {num_tokens} exceeds model.max_position={self.position.num_embeddings}; "
                "truncate inputs (data.max_len) or build the model with a larger max_position"
            )
        # Same summation order as BERT (word + type, then + position) so fp32 results match bit for bit.
        types = self.token_type.weight[0] if token_type_ids_BT is None else self.token_type(token_type_ids_BT)
        x_BTD = self.word(input_ids_BT) + types
        x_BTD = x_BTD + self.position.weight[:num_tokens]
        return self.dropout(self.norm(x_BTD))
