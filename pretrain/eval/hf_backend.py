"""A `transformers` AutoModel/AutoTokenizer behind the same interface as our PretrainModel/Tokenizer.

It is the reference path for "any HF BERT" (and the cross-check for our own HF import): the eval
library and GLUE fine-tuning only need `encode`, `pool` and a tokenizer with `encode`/`cls_id`/...

Legend: B batch, T tokens, D hidden size, L layers (+1 for the embedding output).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from pretrain.console import verbose
from pretrain.prep.tokenizer import ROBERTA_SPECIAL_TOKENS

POOLINGS = ("cls", "cls_before_pooler", "mean", "first_last_avg")


def masked_mean(h_BTD: torch.Tensor, attention_mask_BT: torch.Tensor) -> torch.Tensor:
    """Mean over real tokens: [B, T, D] x [B, T] -> [B, D]."""
    m_BT1 = attention_mask_BT.unsqueeze(-1).to(h_BTD.dtype)
    return (h_BTD * m_BT1).sum(1) / m_BT1.sum(1).clamp(min=1e-9)


def quiet_transformers() -> None:
    """transformers' info/warning logging and progress bars off the console unless PRETRAIN_VERBOSE=1."""
    from transformers.utils import logging as hf_logging


    if not verbose():
        hf_logging.set_verbosity_error()
        hf_logging.disable_progress_bar()


class HFTokenizer:
    """Wraps a `transformers` tokenizer: `encode(text) -> ids` without special tokens."""

    def __init__(self, path: str | Path):
        from transformers import AutoTokenizer

        quiet_transformers()
        self.tok = AutoTokenizer.from_pretrained(str(path))
        self.cls_id = self.tok.cls_token_id
        self.sep_id = self.tok.sep_token_id
        self.pad_id = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        self.vocab_size = len(self.tok)
        names = (self.tok.pad_token, self.tok.unk_token, self.tok.cls_token, self.tok.sep_token, self.tok.mask_token)
        self.roberta_specials = names == ROBERTA_SPECIAL_TOKENS
        """RoBERTa's vocabulary (the rule of our Tokenizer): a sentence pair is <s> a </s></s> b </s>, all type 0."""

    def encode(self, text: str) -> list[int]:
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        return self.tok(list(texts), add_special_tokens=False)["input_ids"]


class HFBackbone(nn.Module):
    """`transformers.AutoModel` exposing `encode(ids, mask, all_layers)` and `pool(...)`."""

    def __init__(self, path: str | Path):
        super().__init__()
        from transformers import AutoModel

        quiet_transformers()
        self.hf = AutoModel.from_pretrained(str(path))
        self.hidden_size = self.hf.config.hidden_size

    def encode(
        self,
        input_ids_BT: torch.Tensor,
        attention_mask_BT: torch.Tensor,
        all_layers: bool = False,
        token_type_ids_BT: torch.Tensor | None = None,
    ):
        """Last hidden state h_BTD, or (h_BTD, [h_BTD per layer incl. embeddings]) if all_layers."""
        out = self.hf(
            input_ids=input_ids_BT,
            attention_mask=attention_mask_BT,
            token_type_ids=token_type_ids_BT,
            output_hidden_states=all_layers,
        )
        self._pooler_out_BD = getattr(out, "pooler_output", None)
        if all_layers:
            return out.last_hidden_state, list(out.hidden_states)
        return out.last_hidden_state

    def pool(self, h_BTD, attention_mask_BT, pooling: str, all_layers=None) -> torch.Tensor:
        """Sentence embedding e_BD (SimCSE's definitions; first_last_avg = layer 1 and layer L)."""
        if pooling == "cls_before_pooler":
            return h_BTD[:, 0]
        if pooling == "cls":
            pooler = getattr(self.hf, "pooler", None)
            if pooler is None:
                raise ValueError("pooling 'cls' needs a model with a pooler; use 'cls_before_pooler'")
            return pooler(h_BTD)
        if pooling == "mean":
            return masked_mean(h_BTD, attention_mask_BT)
        if pooling == "first_last_avg":
            if all_layers is None:
                raise ValueError("first_last_avg needs encode(..., all_layers=True)")
            return masked_mean((all_layers[1] + all_layers[-1]) / 2.0, attention_mask_BT)
        raise ValueError(f"unknown pooling {pooling!r}; choose one of {POOLINGS}")


def load_hf_backbone(path: str | Path) -> tuple[HFBackbone, HFTokenizer]:
    """(backbone, tokenizer) from a HF model directory (config.json + weights + tokenizer files)."""
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} has no config.json; pass a Hugging Face model directory")
    return HFBackbone(p), HFTokenizer(p)
