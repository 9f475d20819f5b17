"""Hugging Face BERT <-> PretrainModel: one key table used both ways, config mapping, export/import.

An export directory (no custom code) holds

    config.json, model.safetensors      BertModel: encoder + pooler (AutoModel, SentenceTransformer)
    mlm/config.json, mlm/model.safetensors
                                        BertForMaskedLM: encoder + MLM head
                                        (AutoModelForMaskedLM.from_pretrained(OUT, subfolder="mlm"))
    tokenizer.json, tokenizer_config.json, special_tokens_map.json
    modules.json, sentence_bert_config.json, N_Pooling/, [N_Dense/], ...  (st_modules: the run's pooling)
    pretrain_projection.safetensors     the contrastive projection head (ours only; ignored by both libraries)
    README.md                           the model card (model_card.py)

transformers 5 reports every checkpoint key a class does not hold: BertModel has no MLM head and
BertForMaskedLM no pooler, so one weights file cannot load quietly into both; the MLM head goes to mlm/
(the encoder is stored twice; ``mlm_head=False`` / ``--no-mlm-head`` leaves it out).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import warnings
from pathlib import Path

import tokenizers
import torch

from pretrain.checkpoint.files import fsync_files, publish_dir, read_safetensors, save_safetensors, write_json
from pretrain.config.loader import to_dict
from pretrain.config.model import ModelConfig
from pretrain.export import hf_modern, hf_roberta
from pretrain.export.hf_tokenizer import (
    SPECIAL_TOKENS,
    clean_tokenizer,
    write_tokenizer_files,
)
from pretrain.export.st_modules import ST_POOLING, write_st_modules
from pretrain.fsutil import fsync_dir, replace_dir
from pretrain.model import TIED_KEYS, PretrainModel, build_model
from pretrain.model.autoencoder import HEADS_FILE
from pretrain.model.init import init_bert_weights
from pretrain.prep.tokenizer import special_token_names

# (ours, hf) per parameter; "{}" is the layer index. HF names are BertForMaskedLM's.
_LAYER_MODULES = [
    ("attn.q", "attention.self.query"),
    ("attn.k", "attention.self.key"),
    ("attn.v", "attention.self.value"),
    ("attn.out", "attention.output.dense"),
    ("attn_norm", "attention.output.LayerNorm"),
    ("ffn.up", "intermediate.dense"),
    ("ffn.down", "output.dense"),
    ("ffn_norm", "output.LayerNorm"),
]
KEY_MAP: list[tuple[str, str]] = [
    ("encoder.embeddings.word.weight", "bert.embeddings.word_embeddings.weight"),
    ("encoder.embeddings.position.weight", "bert.embeddings.position_embeddings.weight"),
    ("encoder.embeddings.token_type.weight", "bert.embeddings.token_type_embeddings.weight"),
    ("encoder.embeddings.norm.weight", "bert.embeddings.LayerNorm.weight"),
    ("encoder.embeddings.norm.bias", "bert.embeddings.LayerNorm.bias"),
    *[
        (f"encoder.layers.{{}}.{ours}.{p}", f"bert.encoder.layer.{{}}.{hf}.{p}")
        for ours, hf in _LAYER_MODULES
        for p in ("weight", "bias")
    ],
    ("pooler.dense.weight", "bert.pooler.dense.weight"),
    ("pooler.dense.bias", "bert.pooler.dense.bias"),
    ("mlm_head.dense.weight", "cls.predictions.transform.dense.weight"),
    ("mlm_head.dense.bias", "cls.predictions.transform.dense.bias"),
    ("mlm_head.norm.weight", "cls.predictions.transform.LayerNorm.weight"),
    ("mlm_head.norm.bias", "cls.predictions.transform.LayerNorm.bias"),
    ("mlm_head.bias", "cls.predictions.bias"),
]
# Ours-only parameters: kept next to the HF weights in PROJECTION_FILE, not in model.safetensors.
OURS_ONLY_PREFIXES = ("projection.",)
PROJECTION_FILE = "pretrain_projection.safetensors"
SENTENCE_PREFIXES = ("sentence_dense.",)
"""Parameters of sentence-transformers modules after pooling (written to their module folders)."""
MLM_SUBDIR = "mlm"
"""The BertForMaskedLM copy of an export (encoder + MLM head)."""
"""BERT's special tokens; a RoBERTa vocabulary has <pad>, <unk>, <s>, </s>, <mask> in these roles (special_tokens)."""
CONFIG_JSON_FIELDS = ("arch", "vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_size", "max_position",
                      "type_vocab_size", "dropout", "attention_dropout", "layer_norm_eps", "activation", "init_std",
                      "norm", "position_offset")
"""The ModelConfig fields every BERT or RoBERTa config.json states (BERT: post-LN, offset 0; RoBERTa: by its
model_type and pad_token_id)."""
PRETRAIN_EXTRA = ("norm", "position_offset", "pooling", "pooler", "projection_dim", "projection_layers",
                  "projection_activation")
"""Our settings that ride along in config.json under "pretrain" (our exports only)."""


def hf_family(cfg: ModelConfig) -> str:
    """The transformers model_type with our model's arithmetic: bert (post-LN, positions from 0), roberta (post-LN,
    model.position_offset > 0), roberta-prelayernorm (pre-LN) or modernbert."""
    if cfg.arch == "modernbert":
        return "modernbert"
    if cfg.norm == "pre" or cfg.position_offset:
        return hf_roberta.family_of(cfg.norm)
    return "bert"


def base_prefix(family: str) -> str:
    """The encoder's key prefix in the family's *ForMaskedLM names (its *Model names are those without it)."""
    return {"bert": "bert.", "modernbert": hf_modern.BASE_PREFIX}.get(family) or hf_roberta.PREFIXES[family]


def _key_map(family: str) -> list[tuple[str, str]]:
    if family == "modernbert":
        return hf_modern.KEY_MAP
    return KEY_MAP if family == "bert" else hf_roberta.key_map(KEY_MAP, family)


def _expand(num_layers: int, arch: str = "bert") -> list[tuple[str, str]]:
    """The key table (ours, transformers') of ``arch`` (a family, see hf_family) with "{}" expanded per layer
    (ModernBERT's table lists layer 0's attn_norm, which exists on neither side)."""
    pairs = []
    for ours, hf in _key_map(arch):
        if "{}" in ours:
            pairs.extend((ours.format(i), hf.format(i)) for i in range(num_layers))
        else:
            pairs.append((ours, hf))
    return pairs


def to_hf_state_dict(ours: dict, num_layers: int, arch: str = "bert") -> dict:
    """Our state_dict -> HF BertForMaskedLM names (those of the family's *ForMaskedLM for ``arch`` roberta,
    roberta-prelayernorm or modernbert; same tensors; tied decoder and projection dropped).

    Any other key without a counterpart (e.g. pre-LN's final LayerNorm under arch=bert) is a ValueError.
    """
    pairs = _expand(num_layers, arch)
    mapped = {o for o, _ in pairs}
    extra = [k for k in ours if k not in mapped and k not in TIED_KEYS
             and not k.startswith(OURS_ONLY_PREFIXES + SENTENCE_PREFIXES)]
    if extra:
        raise ValueError(
            f"parameters with no {arch} counterpart: {', '.join(sorted(extra)[:5])}; only post-LN models "
            f"(model.norm=post) with num_layers={num_layers} export to the HF BERT format (pre-LN: "
            f"roberta-prelayernorm, see hf_family)"
        )
    return {hf: ours[o] for o, hf in pairs if o in ours}


def _normalise_hf_key(key: str) -> str:
    """Accept BertModel (no 'bert.' prefix), BertForMaskedLM/PreTraining and TF-era gamma/beta names."""
    if key.endswith(".gamma"):
        key = key[: -len(".gamma")] + ".weight"
    elif key.endswith(".beta"):
        key = key[: -len(".beta")] + ".bias"
    if not key.startswith(("bert.", "cls.")):
        key = "bert." + key
    return key


def from_hf_state_dict(hf: dict, num_layers: int, arch: str = "bert") -> dict:
    """HF BERT state_dict (BertModel, BertForMaskedLM or BertForPreTraining; ModernBertModel or
    ModernBertForMaskedLM for arch=modernbert) -> our names.

    Keys absent from ``hf`` (pooler, MLM head) are absent from the result; the tied decoder,
    position_ids buffers and the NSP head are ignored.
    """
    if arch == "modernbert":
        norm = {hf_modern.normalise_key(k): v for k, v in hf.items()}
        if not any(k.startswith("decoder.") for k in norm):  # head.* of a *ForSequenceClassification (etc.): the
            norm = {k: v for k, v in norm.items() if not k.startswith("head.")}  # classifier's, not an MLM head
        return {o: norm[hf_key] for o, hf_key in _expand(num_layers, arch) if hf_key in norm}
    if arch in hf_roberta.FAMILIES:
        norm = {hf_roberta.normalise_key(k, arch): v for k, v in hf.items()}
        return {o: norm[hf_key] for o, hf_key in _expand(num_layers, arch) if hf_key in norm}
    norm = {_normalise_hf_key(k): v for k, v in hf.items()}
    if "cls.predictions.bias" not in norm and "cls.predictions.decoder.bias" in norm:
        norm["cls.predictions.bias"] = norm["cls.predictions.decoder.bias"]
    return {o: norm[hf_key] for o, hf_key in _expand(num_layers) if hf_key in norm}


def _token_id(tokenizer, token: str) -> int | None:
    if tokenizer is None:
        return None
    return tokenizer.token_to_id(token)


def hf_config_from_model_config(cfg: ModelConfig, tokenizer, architecture: str = "BertForMaskedLM") -> dict:
    """ModelConfig (+ tokenizer for special ids) -> a BERT config.json dict for ``architecture``.

    ``tokenizer`` is anything with ``token_to_id`` (ours or a ``tokenizers.Tokenizer``), or None.
    Our extra settings (pooling, projection, pre-LN...) ride along under the "pretrain" key. model.arch=modernbert
    gives a ModernBERT config.json, model.position_offset > 0 or model.norm=pre a RoBERTa or RobertaPreLayerNorm one
    (``architecture`` BertModel/BertForMaskedLM becomes its twin; see hf_family).
    """
    names = dict(zip(SPECIAL_TOKENS, special_token_names(tokenizer))) if tokenizer is not None else SPECIAL_TOKENS
    ids = {name: _token_id(tokenizer, names[name]) for name in ("pad", "cls", "sep")}  # BERT's or RoBERTa's names
    if cfg.arch == "modernbert":
        extra = {name: getattr(cfg, name) for name in PRETRAIN_EXTRA
                 if name not in ("norm", "position_offset")}  # always pre-norm, rotary positions
        return hf_modern.hf_config(cfg, ids, architecture, extra)
    d = {
        "architectures": [architecture],
        "model_type": "bert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.ffn_size,
        "hidden_act": hf_modern.ACT_TO_HF[cfg.activation],
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout,
        "max_position_embeddings": cfg.max_position,
        "type_vocab_size": cfg.type_vocab_size,
        "initializer_range": cfg.init_std,
        "layer_norm_eps": cfg.layer_norm_eps,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
        "dtype": "float32",
        "pretrain": {name: getattr(cfg, name) for name in PRETRAIN_EXTRA},
    }
    if hf_family(cfg) != "bert":
        return hf_roberta.hf_config(cfg, d, ids, architecture)
    if ids["pad"] is not None:
        d["pad_token_id"] = ids["pad"]
    return d


def model_config_from_hf_config(d: dict) -> ModelConfig:
    """A BERT or ModernBERT config.json dict -> ModelConfig (ValueError for other or unsupported settings)."""
    model_type = d.get("model_type")
    if model_type == "modernbert":
        return hf_modern.model_config(d, PRETRAIN_EXTRA)
    if model_type not in ("bert", *hf_roberta.FAMILIES):
        raise ValueError(
            f"config.json has model_type={model_type!r}; only BERT, RoBERTa, RoBERTa-PreLayerNorm and ModernBERT "
            f"checkpoints (model_type 'bert', 'roberta', 'roberta-prelayernorm' or 'modernbert') convert"
        )
    for key in ("is_decoder", "add_cross_attention"):  # causal masks / cross-attention: not our encoder's arithmetic
        if d.get(key):
            name = {"bert": "BERT", "roberta": "RoBERTa"}.get(model_type, "RoBERTa-PreLayerNorm")
            raise ValueError(f"config.json has {key}=true: a {name} decoder does not convert (encoders only)")
    if d.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type={d['position_embedding_type']!r} is not supported (absolute only)")
    act = d.get("hidden_act", "gelu")
    if act not in hf_modern.ACT_FROM_HF:
        raise ValueError(f"hidden_act={act!r} is not supported; use one of {', '.join(hf_modern.ACT_FROM_HF)}")
    extra = d.get("pretrain") or {}
    fields = {k: extra[k] for k in PRETRAIN_EXTRA if k in extra}
    fields["max_position"] = d.get("max_position_embeddings", 512)
    if model_type in hf_roberta.FAMILIES:
        fields.update(hf_roberta.model_config_fields(d, extra))
    return ModelConfig(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=d["num_attention_heads"],
        ffn_size=d["intermediate_size"],
        type_vocab_size=d.get("type_vocab_size", 2),
        dropout=d.get("hidden_dropout_prob", 0.1),
        attention_dropout=d.get("attention_probs_dropout_prob", 0.1),
        layer_norm_eps=d.get("layer_norm_eps", 1e-12),
        activation=hf_modern.ACT_FROM_HF[act],
        init_std=d.get("initializer_range", 0.02),
        **fields,
    )  # fmt: skip


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().clone()


def export_hf(
    model: PretrainModel,
    tokenizer_path: str,
    out_dir: str,
    *,
    pooling: str | None = None,
    max_seq_length: int | None = None,
    overwrite: bool = False,
    mlm_head: bool = True,
    projection: bool = True,
    model_card: str | None = None,
    matryoshka_dims: list[int] | None = None,
) -> list[str]:
    """Write a HF BERT + sentence-transformers directory for ``model`` (layout: module docstring).

    Written to a temporary sibling directory and renamed into place: ``out_dir`` is complete or absent.
    ``pooling`` (default: the model's) is what SentenceTransformer(out_dir) applies, through the model's
    pooler, Dense and Normalize settings (st_modules). ``mlm_head=False`` writes no mlm/ and
    ``projection=False`` no projection file (heads never trained, e.g. of a sentence-transformers import).
    ``model_card`` becomes README.md. ``matryoshka_dims`` (objective.matryoshka's sizes) are recorded in config.json
    (``pretrain.matryoshka_dims``): SentenceTransformer(out_dir, truncate_dim=d) for each.
    Returns the sentence-transformers module chain, e.g. ['Transformer', 'Pooling', 'Normalize'].
    """
    cfg = model.cfg
    pooling = pooling or cfg.pooling
    out = Path(out_dir)
    tok = _exportable_tokenizer(cfg, pooling, tokenizer_path, out, overwrite)
    max_tokens = cfg.max_position - cfg.position_offset
    max_len = min(max_seq_length or max_tokens, max_tokens)
    hf_config = hf_config_from_model_config(cfg, tok, architecture="BertModel")
    ours, hf = _hf_weights(model, hf_config.get("pad_token_id"))
    prefix = base_prefix(hf_family(cfg))
    base = {k.removeprefix(prefix): v for k, v in hf.items() if k.startswith(prefix)}  # BertModel's own names
    heads = {k: v for k, v in ours.items() if k.startswith(OURS_ONLY_PREFIXES)} if projection else {}
    hf_config["dtype"] = str(next(iter(hf.values())).dtype).removeprefix("torch.")
    if mlm_head:
        hf_config["pretrain"]["mlm_head"] = MLM_SUBDIR
    if matryoshka_dims:
        hf_config["pretrain"]["matryoshka_dims"] = sorted(map(int, matryoshka_dims), reverse=True)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_safetensors(base, tmp / "model.safetensors", metadata={"format": "pt"})
        write_json(tmp / "config.json", hf_config)
        if mlm_head:
            _write_mlm_dir(tmp / MLM_SUBDIR, hf, prefix, hf_config,
                           hf_config_from_model_config(cfg, tok, "BertForMaskedLM")["architectures"])
        if heads:
            save_safetensors(heads, tmp / PROJECTION_FILE, metadata={"format": "pt"})
        write_tokenizer_files(tok, tmp, max_len, token_types=cfg.arch != "modernbert" and cfg.type_vocab_size > 1)
        chain = write_st_modules(tmp, cfg, pooling, ours, max_len)
        if model_card is not None:
            (tmp / "README.md").write_text(model_card, encoding="utf-8")
        publish_dir(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return chain


def _write_mlm_dir(mlm_dir: Path, hf: dict, prefix: str, hf_config: dict, architectures: list[str]) -> None:
    """mlm/: the encoder and MLM head (no pooler) with the masked-LM class's config."""
    mlm_dir.mkdir()
    mlm = {k: v for k, v in hf.items() if not k.startswith(prefix + "pooler.")}
    save_safetensors(mlm, mlm_dir / "model.safetensors", metadata={"format": "pt"})
    write_json(mlm_dir / "config.json", {**hf_config, "architectures": architectures})


def _hf_weights(model: PretrainModel, pad_id: int | None = None) -> tuple[dict, dict]:
    """(our state dict on the CPU without tied copies, the same as a BertForMaskedLM state dict: the family's,
    see hf_family; ``pad_id`` places a RoBERTa family's position table)."""
    cfg = model.cfg
    family = hf_family(cfg)
    ours = {k: _cpu_copy(v) for k, v in model.state_dict().items() if k not in TIED_KEYS}
    hf = to_hf_state_dict(ours, cfg.num_layers, family)
    prefix = base_prefix(family)
    if family in hf_roberta.FAMILIES:
        rows = hf_roberta.leading_rows(pad_id, cfg.position_offset)
        hf = hf_roberta.shift_positions(hf, prefix + "embeddings.position_embeddings.weight", rows)
    if cfg.arch == "bert" and prefix + "pooler.dense.weight" not in hf:
        # BertModel (RobertaModel) always has a pooler (a missing one is reported): zeros, which our import drops
        # again since config.json says "pretrain": {"pooler": false}.
        hf[prefix + "pooler.dense.weight"] = torch.zeros(cfg.hidden_size, cfg.hidden_size)
        hf[prefix + "pooler.dense.bias"] = torch.zeros(cfg.hidden_size)
    return ours, hf


def _exportable_tokenizer(cfg: ModelConfig, pooling: str, tokenizer_path: str, out: Path, overwrite: bool):
    """The cleaned tokenizer to export with, after the checks that the model, pooling, tokenizer and output
    directory allow an export (ValueError / FileNotFoundError saying what to change)."""
    if pooling not in ST_POOLING:
        raise ValueError(
            f"pooling {pooling!r} cannot be expressed in sentence-transformers here; "
            f"export with one of {', '.join(ST_POOLING)}"
        )
    if not os.path.isfile(tokenizer_path):
        raise FileNotFoundError(f"tokenizer file {tokenizer_path} not found; pass the run's data.tokenizer path")
    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; remove it or pass overwrite=True (--overwrite)")
    tok = clean_tokenizer(tokenizers.Tokenizer.from_file(tokenizer_path))
    if tok.get_vocab_size(with_added_tokens=True) > cfg.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer_path} has {tok.get_vocab_size(with_added_tokens=True)} tokens but the model's "
            f"vocab_size is {cfg.vocab_size}; pass the tokenizer the model was trained with"
        )
    return tok


# ----------------------------------------------------------------------------- import


DECODER_KEYS = {"bert": "cls.predictions.decoder.weight", "roberta": "lm_head.decoder.weight",
                "roberta-prelayernorm": "lm_head.decoder.weight", "modernbert": "decoder.weight"}
"""The MLM decoder matrix in each family's *ForMaskedLM names (saved only when not tied to the word embeddings)."""


def untied_decoder(hf: dict, family: str) -> bool:
    """Whether the HF state dict ``hf`` (the family's names) has an MLM decoder of its own, other than its word
    embeddings (tie_word_embeddings=false): our MLM head always reads the word embeddings."""
    decoder = hf.get(DECODER_KEYS[family])
    word_key = next(h for o, h in _key_map(family) if o == "encoder.embeddings.word.weight")
    word = hf.get(word_key, hf.get(word_key.removeprefix(base_prefix(family))))
    if decoder is None or word is None:
        return False
    return decoder.shape != word.shape or not torch.equal(decoder.float(), word.float())


def model_with_state(
    cfg: ModelConfig, state: dict, *, source: str, required_prefixes: tuple[str, ...] = ("encoder.",),
    warn_fresh_head: bool = True,
) -> PretrainModel:
    """PretrainModel(cfg) holding ``state`` (our names; tensors are taken over, not copied).

    Keys under ``required_prefixes`` (and the Dense layer after pooling, part of the sentence embedding) must
    all be present (ValueError otherwise); missing MLM-head weights are freshly initialised with a warning
    (unless ``warn_fresh_head`` is False), missing projection weights silently.
    """
    model = build_model(cfg, init=False)
    expected = model.state_dict()
    unexpected = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state) - set(TIED_KEYS))
    bad_shape = [k for k in state if k in expected and state[k].shape != expected[k].shape]
    if unexpected or bad_shape or any(k.startswith(required_prefixes + SENTENCE_PREFIXES) for k in missing):
        raise ValueError(
            f"{source} does not fit the model its config describes: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}, wrong shape {bad_shape[:4]}; is it a complete BERT/PretrainModel checkpoint?"
        )
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False, assign=True)
    model.tie_weights()
    for name in sorted({k.split(".")[0] for k in missing}):
        if name == "mlm_head" and warn_fresh_head:
            warnings.warn(f"{source} has no MLM head weights; the MLM head is freshly initialised", stacklevel=3)
        init_bert_weights(getattr(model, name), cfg.init_std)
    return model


# ----------------------------------------------------------------------------- our "init" directory

INIT_WEIGHTS = "model.safetensors"
INIT_CONFIG = "config.yaml"
INIT_TOKENIZER = "tokenizer.json"
INIT_FIX = ("copy it again or write it again (pretrain-convert from-hf); a run's best/ is rewritten by the run's next "
            "better STS-B evaluation: read a checkpoint of the run meanwhile (--checkpoint latest)")
"""What to do about a damaged file of an init directory (``read_safetensors``'s ``fix``)."""


def write_init_dir(model: PretrainModel, tokenizer_path: str, out_dir: str, *, overwrite: bool = False,
                   state_keys=None, model_fields=None, data: dict | None = None, source: str | None = None,
                   extra_files: dict[str, str] | None = None, heads: dict | None = None) -> None:
    """Write OUT/{model.safetensors (our key names), config.yaml (model: + data.tokenizer), tokenizer.json},
    a directory the trainer starts from with ``checkpoint.init_from=OUT``. Complete or absent: written beside it,
    fsynced, then swapped in (``replace_dir``), so a directory it replaces stays whole until the new one is.
    ``extra_files``: more text files ({name: text}) that belong to the same version (the run's best.json).
    ``heads``: the objective's trainable heads (``heads.*`` tensors: SARCSE's autoencoder) as heads.safetensors.

    ``state_keys``: the weights to write (default all; an import leaves out heads it never had, so nobody takes
    a fresh head for a trained one). ``model_fields``: the model.* settings the source states (default all;
    the rest stay ModelConfig defaults, which a run's config may set). ``data``: more data.* settings the
    source states (e.g. max_len); ``source``: where the weights came from (for the model card)."""
    import yaml


    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; remove it or pass overwrite=True (--overwrite)")
    keep = set(state_keys) if state_keys is not None else None
    state = {k: _cpu_copy(v) for k, v in model.state_dict().items()
             if k not in TIED_KEYS and (keep is None or k in keep)}
    model_dict = to_dict(model.cfg)
    if model_fields is not None:
        model_dict = {k: v for k, v in model_dict.items() if k in set(model_fields)}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_safetensors(state, tmp / INIT_WEIGHTS, metadata={"format": "pt"})
        if heads:
            save_safetensors({k: _cpu_copy(v) for k, v in heads.items()}, tmp / HEADS_FILE, metadata={"format": "pt"})
        shutil.copyfile(tokenizer_path, tmp / INIT_TOKENIZER)
        # Relative to the directory: a moved or copied init dir (or run's best/) still opens its own tokenizer.
        config = {"model": model_dict, "data": {"tokenizer": INIT_TOKENIZER, **(data or {})}}
        if source:
            config["converted_from"] = source
        (tmp / INIT_CONFIG).write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        for name, text in (extra_files or {}).items():
            (tmp / name).write_text(text, encoding="utf-8")
        fsync_files(p for p in tmp.iterdir() if p.is_file())
        fsync_dir(tmp)
        publish_dir(tmp)
        replace_dir(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_init_weights(path: str) -> dict:
    """State dict (our names, tied aliases filled in) from an init directory or its model.safetensors."""
    p = Path(path)
    f = p / INIT_WEIGHTS if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found; create an init directory with `pretrain-convert from-hf HF_DIR OUT`")
    state = read_safetensors(f, fix=INIT_FIX)
    for alias, source in TIED_KEYS.items():
        if alias not in state and source in state:
            state[alias] = state[source]
    return state
