"""Hugging Face ModernBERT <-> PretrainModel (model.arch=modernbert): key table both ways and config.json mapping.

The export layout is hf.py's (root ModernBertModel, mlm/ ModernBertForMaskedLM); this module holds what differs
from BERT. transformers' names are ModernBertForMaskedLM's: the encoder under "model.", the MLM head's transform
under "head.", the decoder's bias "decoder.bias" (its weight is tied to the word embeddings). Layer 0 has no
attention norm on either side.
"""

from __future__ import annotations

from pretrain.config.model import ModelConfig

# (ours, hf) per parameter; "{}" is the layer index.
_LAYER_MODULES = [
    ("attn_norm", "attn_norm"),
    ("attn.qkv", "attn.Wqkv"),
    ("attn.out", "attn.Wo"),
    ("ffn_norm", "mlp_norm"),
    ("ffn.wi", "mlp.Wi"),
    ("ffn.wo", "mlp.Wo"),
]
KEY_MAP: list[tuple[str, str]] = [
    ("encoder.embeddings.word.weight", "model.embeddings.tok_embeddings.weight"),
    ("encoder.embeddings.norm.weight", "model.embeddings.norm.weight"),
    *[(f"encoder.layers.{{}}.{ours}.weight", f"model.layers.{{}}.{hf}.weight") for ours, hf in _LAYER_MODULES],
    ("encoder.final_norm.weight", "model.final_norm.weight"),
    ("mlm_head.dense.weight", "head.dense.weight"),
    ("mlm_head.norm.weight", "head.norm.weight"),
    ("mlm_head.bias", "decoder.bias"),
]
BASE_PREFIX = "model."
"""ModernBertModel's own names are ModernBertForMaskedLM's without this prefix."""
HEAD_PREFIXES = ("head.", "decoder.")
"""ModernBertForMaskedLM's keys outside the encoder (the MLM head)."""
ARCHITECTURES = {"BertModel": "ModernBertModel", "BertForMaskedLM": "ModernBertForMaskedLM"}
ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
"""model.activation -> the transformers (ACT2FN) name, for BERT, RoBERTa and ModernBERT configs alike."""
ACT_FROM_HF = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "relu": "relu"}
CONFIG_JSON_FIELDS = ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_size", "max_position",
                      "dropout", "attention_dropout", "layer_norm_eps", "activation", "init_std", "local_window",
                      "global_every", "rope_theta", "rope_theta_local", "pooler")
"""The ModelConfig fields every ModernBERT config.json states."""


def normalise_key(key: str) -> str:
    """ModernBertModel's names (no "model." prefix) -> ModernBertForMaskedLM's."""
    return key if key.startswith(BASE_PREFIX) or key.startswith(HEAD_PREFIXES) else BASE_PREFIX + key


def layer_types(cfg: ModelConfig) -> list[str]:
    return ["full_attention" if i % cfg.global_every == 0 else "sliding_attention" for i in range(cfg.num_layers)]


def hf_config(cfg: ModelConfig, token_ids: dict, architecture: str, extra: dict) -> dict:
    """ModelConfig -> a ModernBERT config.json dict; ``token_ids``: pad/cls/sep ids of the tokenizer (or None).
    Dropout: ours is on the embeddings and each residual branch; transformers' embedding_dropout and
    attention_dropout are set to ours (exact in eval, where they are off)."""
    return {
        "architectures": [ARCHITECTURES.get(architecture, architecture)],
        "model_type": "modernbert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.ffn_size,
        "hidden_activation": ACT_TO_HF[cfg.activation],
        "classifier_activation": ACT_TO_HF[cfg.activation],
        "max_position_embeddings": cfg.max_position,
        "initializer_range": cfg.init_std,
        "norm_eps": cfg.layer_norm_eps,
        "norm_bias": False, "attention_bias": False, "mlp_bias": False, "classifier_bias": False,
        "decoder_bias": True,
        "embedding_dropout": cfg.dropout,
        "attention_dropout": cfg.attention_dropout,
        "mlp_dropout": 0.0,
        "local_attention": cfg.local_window,
        "global_attn_every_n_layers": cfg.global_every,
        "layer_types": layer_types(cfg),
        "rope_parameters": {"full_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta},
                            "sliding_attention": {"rope_type": "default", "rope_theta": cfg.rope_theta_local}},
        "pad_token_id": token_ids.get("pad"),
        "cls_token_id": token_ids.get("cls"), "bos_token_id": token_ids.get("cls"),
        "sep_token_id": token_ids.get("sep"), "eos_token_id": token_ids.get("sep"),
        "tie_word_embeddings": True,
        "dtype": "float32",
        "pretrain": extra,
    }  # fmt: skip


def _rope_theta(d: dict, kind: str, old_key: str, default: float) -> float:
    params = (d.get("rope_parameters") or {}).get(kind) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(f"rope_parameters.{kind}.rope_type={params['rope_type']!r} is not supported (default only)")
    return float(params.get("rope_theta", d.get(old_key, default)))


def _global_every(d: dict, num_layers: int) -> int:
    """N such that layer i is global iff i % N == 0, from layer_types (or the older global_attn_every_n_layers);
    another pattern is a ValueError."""
    types = d.get("layer_types")
    if not types:
        return int(d.get("global_attn_every_n_layers", 3))
    full = [i for i, t in enumerate(types) if t == "full_attention"]
    every = full[1] if len(full) > 1 else max(num_layers, 1)
    if [("full_attention" if i % every == 0 else "sliding_attention") for i in range(num_layers)] != list(types):
        raise ValueError(f"layer_types {types} is not 'global every N layers from layer 0', which is all "
                         f"model.arch=modernbert expresses")
    return every


def model_config(d: dict, extra_fields: tuple[str, ...]) -> ModelConfig:
    """A ModernBERT config.json dict -> ModelConfig (ValueError for settings our encoder does not compute)."""
    for key, want in (("norm_bias", False), ("attention_bias", False), ("mlp_bias", False),
                      ("classifier_bias", False), ("decoder_bias", True)):
        if d.get(key, want) != want:
            raise ValueError(f"ModernBERT config.json has {key}={d[key]!r}; only {key}={want} converts")
    act = d.get("hidden_activation", "gelu")
    if act not in ACT_FROM_HF or d.get("classifier_activation", act) != act:
        raise ValueError(f"hidden_activation={act!r} with classifier_activation="
                         f"{d.get('classifier_activation')!r}: only one of {', '.join(ACT_FROM_HF)} for both converts")
    extra = d.get("pretrain") or {}
    num_layers = d["num_hidden_layers"]
    return ModelConfig(
        arch="modernbert",
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_layers=num_layers,
        num_heads=d["num_attention_heads"],
        ffn_size=d["intermediate_size"],
        max_position=d.get("max_position_embeddings", 8192),
        dropout=d.get("embedding_dropout", 0.0),
        attention_dropout=d.get("attention_dropout", 0.0),
        layer_norm_eps=d.get("norm_eps", 1e-5),
        activation=ACT_FROM_HF[act],
        init_std=d.get("initializer_range", 0.02),
        local_window=d.get("local_attention", 128),
        global_every=_global_every(d, num_layers),
        rope_theta=_rope_theta(d, "full_attention", "global_rope_theta", 160000.0),
        rope_theta_local=_rope_theta(d, "sliding_attention", "local_rope_theta", 10000.0),
        pooler=False,
        **{k: extra[k] for k in extra_fields if k in extra and k != "pooler"},
    )  # fmt: skip
