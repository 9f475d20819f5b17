"""A `transformers` AutoModel/AutoTokenizer behind the same interface as our PretrainModel/Tokenizer.

It is the reference path for "any HF BERT" (and the cross-check for our own HF import): the eval
library and GLUE fine-tuning only need `encode`, `pool` and a tokenizer with `encode`/`cls_id`/...

Legend: B batch, T tokens, D hidden size, L layers (+1 for the embedding output).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pretrain.checkpoint.files import check_safetensors
from pretrain.console import verbose
from pretrain.export.hf_tokenizer import lowercase_first, st_lowercases
from pretrain.export.hf_weights import refuse_pickled_weights
from pretrain.export.st_modules import read_st_modules
from pretrain.model.heads import SentenceDense
from pretrain.prep.tokenizer import ROBERTA_SPECIAL_TOKENS

POOLINGS = ("cls", "cls_before_pooler", "mean", "first_last_avg")
SAFETENSORS_FILES = ("model.safetensors", "model.safetensors.index.json")
"""What a Hugging Face directory's weights are read from (a pickle is refused: export.hf_weights)."""


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
        # A directory handed to us runs no code of its own (an auto_map in tokenizer_config.json): refused, not asked.
        self.tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
        if st_lowercases(path):  # as SentenceTransformer tokenizes a do_lower_case model (the pretrain backend too)
            lowercase_first(self.tok.backend_tokenizer)
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
    """`transformers.AutoModel` exposing `encode(ids, mask, all_layers)` and `pool(...)`; with
    `read_sentence_modules`, `pool` applies a sentence-transformers directory's Dense and Normalize too."""

    def __init__(self, path: str | Path):
        super().__init__()
        from transformers import AutoModel

        quiet_transformers()
        # float32 whatever the directory was saved in: transformers 5 loads a config's "dtype": "float16"/"bfloat16"
        # as such by default, which would run (and fine-tune) the model in half precision, unlike SimCSE's fp32 runs.
        for weights in sorted(Path(path).glob("*.safetensors")):  # a cut copy: one line naming it, as the pretrain
            check_safetensors(weights)  # backend says it, not transformers' SafetensorError traceback
        self.hf = AutoModel.from_pretrained(str(path), use_safetensors=True, trust_remote_code=False,
                                            dtype=torch.float32)
        self.hidden_size = self.hf.config.hidden_size
        self.sentence_dense: nn.Module | None = None
        """sentence-transformers' Dense after pooling (besides BERT's pooler, which pooling 'cls' is)."""
        self.normalize = False
        """sentence-transformers' Normalize: L2-normalised embeddings."""
        self.stated_pooling: str | None = None
        """The pooling a sentence-transformers directory's modules state (our name for it); None otherwise."""

    def read_sentence_modules(self, d: Path) -> None:
        """A sentence-transformers directory's modules after the Transformer, for ``pool``: read as the pretrain
        backend reads them (export.st_modules: module paths inside ``d``; Dense weights from model.safetensors, a
        pickle never read, as every HF weight file here), so that both backends embed alike;
        a module neither can apply is a ValueError naming it. (GLUE reads token states only: it does not call this.)"""
        modules = json.loads((d / "modules.json").read_text(encoding="utf-8"))
        if not isinstance(modules, list):
            raise ValueError(f"{d / 'modules.json'} is not a list of modules; is it a sentence-transformers model?")
        pooler = getattr(getattr(self.hf, "pooler", None), "dense", None)  # to tell BERT's pooler from a Dense
        state = {} if pooler is None else {"pooler.dense.weight": pooler.weight.detach(),
                                           "pooler.dense.bias": pooler.bias.detach()}
        recorded = (json.loads((d / "config.json").read_text(encoding="utf-8")).get("pretrain") or {}).get("pooling")
        try:
            st = read_st_modules(d, modules, num_layers=self.hf.config.num_hidden_layers, hidden=self.hidden_size,
                                 state=state, recorded_pooling=recorded)
        except ValueError as e:
            raise ValueError(f"{e}; --backend transformers applies a sentence-transformers model's modules, and "
                             f"cannot apply these: evaluate the model with sentence-transformers itself") from None
        f = st.fields
        self.stated_pooling, self.normalize = f["pooling"], f["normalize"]
        if f["dense_dim"]:
            linear = nn.Linear(self.hidden_size, f["dense_dim"], bias=f["dense_bias"])
            try:
                linear.load_state_dict({k.removeprefix("sentence_dense.linear."): v for k, v in st.state.items()})
            except RuntimeError as e:
                raise ValueError(f"{d}: the Dense module's weights do not match its config.json ({e})") from None
            self.sentence_dense = nn.Sequential(linear, SentenceDense.ACTIVATIONS[f["dense_activation"]]())

    @property
    def max_tokens(self) -> int | None:
        """The longest sequence the position table holds (RoBERTa's: its rows less pad + 1, where positions
        start); None without a table (rotary positions: ModernBERT)."""
        emb = getattr(self.hf, "embeddings", None)
        table = getattr(emb, "position_embeddings", None)
        if not isinstance(table, nn.Embedding):
            return None
        pad = getattr(emb, "padding_idx", None)
        return table.num_embeddings - (pad + 1 if pad is not None else 0)

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
        """Sentence embedding e_BD: pooling (SimCSE's definitions; first_last_avg = layer 1 and layer L), then a
        sentence-transformers directory's Dense and Normalize, as PretrainModel.pool."""
        e_BD = self._pooled(h_BTD, attention_mask_BT, pooling, all_layers)
        if self.sentence_dense is not None:
            e_BD = self.sentence_dense(e_BD)
        if self.normalize:
            e_BD = F.normalize(e_BD, p=2.0, dim=-1)
        return e_BD

    def _pooled(self, h_BTD, attention_mask_BT, pooling: str, all_layers=None) -> torch.Tensor:
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
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist; pass a Hugging Face model directory")
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"{p} has no config.json; pass a Hugging Face model directory")
    if not any((p / name).is_file() for name in SAFETENSORS_FILES):
        refuse_pickled_weights(p)
        raise ValueError(f"{p} holds no model.safetensors; pretrain reads a directory it is handed from safetensors "
                         f"only")
    return HFBackbone(p), HFTokenizer(p)
