"""Hugging Face RoBERTa and RoBERTa-PreLayerNorm <-> PretrainModel (model.arch=bert): what differs from BERT.

RoBERTa's arithmetic is BERT's post-LN encoder with two differences we express as settings of model.arch=bert:
positions start at pad_token_id + 1 (model.position_offset; padding takes row pad_token_id) and the MLM head's
activation is always GELU. RobertaPreLayerNorm (transformers' ``roberta-prelayernorm``) is our pre-LN encoder
(model.norm=pre) exactly: x + attn(LN(x)), x + ffn(LN(x)) per layer, LayerNorm'd embeddings, a final LayerNorm
before the pooler and the MLM head. Its per-layer norms sit in ``attention.LayerNorm`` and
``intermediate.LayerNorm``, the final one in ``roberta_prelayernorm.LayerNorm``.

The position table: transformers' RoBERTa numbers a sequence's tokens from pad_token_id + 1. A model of ours with
model.position_offset=0 (a pre-LN BERT trained here) exports with pad_token_id + 1 rows put in front of its table
(zeros; real tokens never read them, padding reads row pad_token_id) and config.json's "pretrain" block records
position_offset=0, so the import takes those rows away again. Names are RobertaForMaskedLM's: the encoder under
"roberta." ("roberta_prelayernorm."), the head under "lm_head." (dense, layer_norm, bias; decoder tied).
"""

from __future__ import annotations

import torch

from pretrain.config.model import ModelConfig

FAMILIES = ("roberta", "roberta-prelayernorm")
"""transformers model_types this module maps (config.json "model_type")."""
PREFIXES = {"roberta": "roberta.", "roberta-prelayernorm": "roberta_prelayernorm."}
"""The encoder's key prefix in the *ForMaskedLM class; the *Model class's names are those without it."""
CLASS_NAMES = {"roberta": "Roberta", "roberta-prelayernorm": "RobertaPreLayerNorm"}
HEAD_PREFIXES = ("lm_head.",)
POSITION_KEY = "encoder.embeddings.position.weight"
_HEAD = [("cls.predictions.transform.dense.", "lm_head.dense."),
         ("cls.predictions.transform.LayerNorm.", "lm_head.layer_norm."),
         ("cls.predictions.bias", "lm_head.bias")]


def family_of(norm: str) -> str:
    """The transformers model_type of a RoBERTa-style model of ours (model.norm post or pre)."""
    return "roberta-prelayernorm" if norm == "pre" else "roberta"


def _rename(bert_key: str, family: str) -> str:
    """One BertForMaskedLM name (hf.KEY_MAP's) -> the family's."""
    for bert, roberta in _HEAD:
        if bert_key.startswith(bert):
            return roberta + bert_key[len(bert):]
    key = PREFIXES[family] + bert_key.removeprefix("bert.")
    if family == "roberta-prelayernorm":  # per-layer norms sit before their sublayer, under other names
        key = key.replace("{}.output.LayerNorm.", "{}.intermediate.LayerNorm.")
        key = key.replace("{}.attention.output.LayerNorm.", "{}.attention.LayerNorm.")
    return key


def key_map(bert_map: list[tuple[str, str]], family: str) -> list[tuple[str, str]]:
    """hf.KEY_MAP (ours, BERT's) -> (ours, the family's *ForMaskedLM name); pre-LN adds the final LayerNorm."""
    pairs = [(ours, _rename(hf, family)) for ours, hf in bert_map]
    if family == "roberta-prelayernorm":
        pairs += [(f"encoder.final_norm.{p}", f"{PREFIXES[family]}LayerNorm.{p}") for p in ("weight", "bias")]
    return pairs


def normalise_key(key: str, family: str) -> str:
    """*Model names (no prefix) -> *ForMaskedLM's; the decoder's own bias is the head's bias (tied)."""
    if key == "lm_head.decoder.bias":
        return "lm_head.bias"
    if key.startswith(HEAD_PREFIXES) or key.startswith(PREFIXES[family]):
        return key
    return PREFIXES[family] + key


def leading_rows(pad_id: int, position_offset: int) -> int:
    """Rows transformers' table has before ours: its first real token takes row pad_id + 1, ours row offset."""
    rows = pad_id + 1 - position_offset
    if position_offset and rows:
        raise ValueError(f"model.position_offset={position_offset} but the tokenizer's pad id is {pad_id}: RoBERTa "
                         f"numbers positions from pad_token_id + 1 = {pad_id + 1}; train with "
                         f"model.position_offset={pad_id + 1} (or 0, BERT's numbering) to export")
    return rows


def shift_positions(hf: dict, key: str, rows: int) -> dict:
    """``hf`` with ``rows`` zero rows put in front of the position table at ``key`` (export of an offset-0 model)."""
    if rows:
        table = hf[key]
        hf[key] = torch.cat([table.new_zeros(rows, table.shape[1]), table])
    return hf


def hf_config(cfg: ModelConfig, bert: dict, token_ids: dict, architecture: str) -> dict:
    """Our BERT config.json dict ``bert`` (hf.hf_config_from_model_config's) -> the RoBERTa family's: model_type,
    class, pad/bos/eos ids (``token_ids``: pad, cls, sep of the tokenizer) and the position table's size."""
    if cfg.activation != "gelu":
        raise ValueError(f"model.activation={cfg.activation!r}: transformers' RoBERTa MLM head always applies the "
                         f"exact GELU, so only model.activation=gelu exports to RoBERTa (position_offset > 0 or pre-LN)")
    family = family_of(cfg.norm)
    pad = token_ids.get("pad")
    if pad is None:
        if not cfg.position_offset:
            raise ValueError("a RoBERTa-style export of a model with model.position_offset=0 needs the tokenizer's "
                             "pad id; pass the tokenizer")
        pad = cfg.position_offset - 1
    rows = leading_rows(pad, cfg.position_offset)
    suffix = architecture.removeprefix("Bert")
    return {**bert, "architectures": [CLASS_NAMES[family] + suffix], "model_type": family,
            "max_position_embeddings": cfg.max_position + rows, "pad_token_id": pad,
            "bos_token_id": token_ids.get("cls"), "eos_token_id": token_ids.get("sep")}


def model_config_fields(d: dict, extra: dict) -> dict:
    """A RoBERTa-family config.json dict -> the ModelConfig fields that differ from BERT's reading of it
    (norm, position_offset, max_position); ValueError for settings our encoder does not compute."""
    if d.get("hidden_act", "gelu") != "gelu":
        raise ValueError(f"config.json has hidden_act={d['hidden_act']!r}: our MLM head applies model.activation, "
                         f"RoBERTa's always the exact GELU, so only hidden_act=gelu converts")
    pad = d.get("pad_token_id", 1)
    if not isinstance(pad, int) or pad < 0:
        raise ValueError(f"config.json has pad_token_id={pad!r}; RoBERTa's positions start at pad_token_id + 1, so "
                         f"it must be a token id >= 0")
    offset = int(extra.get("position_offset", pad + 1))
    rows = leading_rows(pad, offset)
    size = d.get("max_position_embeddings", 514)
    if size - rows <= offset:
        raise ValueError(f"config.json has max_position_embeddings={size} and pad_token_id={pad}: no position is "
                         f"left for a token (they start at row {pad + 1})")
    return {"norm": "pre" if d["model_type"] == "roberta-prelayernorm" else "post", "position_offset": offset,
            "max_position": size - rows}


def drop_leading_rows(state: dict, d: dict, cfg: ModelConfig) -> dict:
    """Our state from a RoBERTa-family checkpoint without the table rows our numbering does not use (see
    ``shift_positions``)."""
    rows = leading_rows(d.get("pad_token_id", 1), cfg.position_offset)
    if rows and POSITION_KEY in state:
        state[POSITION_KEY] = state[POSITION_KEY][rows:]
    return state
