"""Hugging Face BERT <-> PretrainModel: one key table used both ways, config mapping, export/import.

An export directory loads with ``transformers`` (AutoModel, AutoModelForMaskedLM, AutoTokenizer;
BERT architecture, safetensors, no custom code) and with ``sentence_transformers.SentenceTransformer``
(modules.json + pooling config reproduce the pooling the run used).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import warnings
from pathlib import Path

import torch

from pretrain.config.model import ModelConfig
from pretrain.model import TIED_KEYS, PretrainModel, build_model
from pretrain.model.init import init_bert_weights

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
SPECIAL_TOKENS = {"pad": "[PAD]", "unk": "[UNK]", "cls": "[CLS]", "sep": "[SEP]", "mask": "[MASK]"}
_ACT_TO_HF = {"gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh", "relu": "relu"}
_ACT_FROM_HF = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "gelu_new": "gelu_tanh", "relu": "relu"}
_ST_POOLING_MODES = {"cls": "pooling_mode_cls_token", "cls_before_pooler": "pooling_mode_cls_token",
                     "mean": "pooling_mode_mean_tokens", "first_last_avg": "pooling_mode_mean_tokens"}  # fmt: skip


def _expand(num_layers: int) -> list[tuple[str, str]]:
    pairs = []
    for ours, hf in KEY_MAP:
        if "{}" in ours:
            pairs.extend((ours.format(i), hf.format(i)) for i in range(num_layers))
        else:
            pairs.append((ours, hf))
    return pairs


def to_hf_state_dict(ours: dict, num_layers: int) -> dict:
    """Our state_dict -> HF BertForMaskedLM names (same tensors; tied decoder and projection dropped).

    Any other key without a BERT counterpart (e.g. pre-LN's final LayerNorm) is a ValueError.
    """
    pairs = _expand(num_layers)
    mapped = {o for o, _ in pairs}
    extra = [k for k in ours if k not in mapped and k not in TIED_KEYS and not k.startswith(OURS_ONLY_PREFIXES)]
    if extra:
        raise ValueError(
            f"parameters with no BERT counterpart: {', '.join(sorted(extra)[:5])}; only post-LN models "
            f"(model.norm=post) with num_layers={num_layers} export to the HF BERT format"
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


def from_hf_state_dict(hf: dict, num_layers: int) -> dict:
    """HF BERT state_dict (BertModel, BertForMaskedLM or BertForPreTraining) -> our names.

    Keys absent from ``hf`` (pooler, MLM head) are absent from the result; the tied decoder,
    position_ids buffers and the NSP head are ignored.
    """
    norm = {_normalise_hf_key(k): v for k, v in hf.items()}
    if "cls.predictions.bias" not in norm and "cls.predictions.decoder.bias" in norm:
        norm["cls.predictions.bias"] = norm["cls.predictions.decoder.bias"]
    return {o: norm[hf_key] for o, hf_key in _expand(num_layers) if hf_key in norm}


def _token_id(tokenizer, token: str) -> int | None:
    if tokenizer is None:
        return None
    return tokenizer.token_to_id(token)


def hf_config_from_model_config(cfg: ModelConfig, tokenizer) -> dict:
    """ModelConfig (+ tokenizer for special ids) -> a BERT config.json dict (BertForMaskedLM).

    ``tokenizer`` is anything with ``token_to_id`` (ours or a ``tokenizers.Tokenizer``), or None.
    Our extra settings (pooling, projection, pre-LN...) ride along under the "pretrain" key.
    """
    d = {
        "architectures": ["BertForMaskedLM"],
        "model_type": "bert",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "intermediate_size": cfg.ffn_size,
        "hidden_act": _ACT_TO_HF[cfg.activation],
        "hidden_dropout_prob": cfg.dropout,
        "attention_probs_dropout_prob": cfg.attention_dropout,
        "max_position_embeddings": cfg.max_position,
        "type_vocab_size": cfg.type_vocab_size,
        "initializer_range": cfg.init_std,
        "layer_norm_eps": cfg.layer_norm_eps,
        "position_embedding_type": "absolute",
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "pretrain": {
            "norm": cfg.norm,
            "pooling": cfg.pooling,
            "pooler": cfg.pooler,
            "projection_dim": cfg.projection_dim,
            "projection_layers": cfg.projection_layers,
            "projection_activation": cfg.projection_activation,
        },
    }
    pad = _token_id(tokenizer, SPECIAL_TOKENS["pad"])
    if pad is not None:
        d["pad_token_id"] = pad
    return d


def model_config_from_hf_config(d: dict) -> ModelConfig:
    """A BERT config.json dict -> ModelConfig (ValueError for non-BERT or unsupported settings)."""
    model_type = d.get("model_type")
    if model_type != "bert":
        raise ValueError(
            f"config.json has model_type={model_type!r}; only BERT checkpoints (model_type 'bert') convert"
        )
    if d.get("position_embedding_type", "absolute") != "absolute":
        raise ValueError(f"position_embedding_type={d['position_embedding_type']!r} is not supported (absolute only)")
    act = d.get("hidden_act", "gelu")
    if act not in _ACT_FROM_HF:
        raise ValueError(f"hidden_act={act!r} is not supported; use one of {', '.join(_ACT_FROM_HF)}")
    extra = d.get("pretrain") or {}
    return ModelConfig(
        vocab_size=d["vocab_size"],
        hidden_size=d["hidden_size"],
        num_layers=d["num_hidden_layers"],
        num_heads=d["num_attention_heads"],
        ffn_size=d["intermediate_size"],
        max_position=d.get("max_position_embeddings", 512),
        type_vocab_size=d.get("type_vocab_size", 2),
        dropout=d.get("hidden_dropout_prob", 0.1),
        attention_dropout=d.get("attention_probs_dropout_prob", 0.1),
        layer_norm_eps=d.get("layer_norm_eps", 1e-12),
        activation=_ACT_FROM_HF[act],
        init_std=d.get("initializer_range", 0.02),
        **{k: extra[k] for k in ("norm", "pooling", "pooler", "projection_dim", "projection_layers",
                                  "projection_activation") if k in extra},
    )  # fmt: skip


# ----------------------------------------------------------------------------- tokenizer files


def clean_tokenizer(tok):
    """A ``tokenizers.Tokenizer`` ready for export: no padding/truncation, [CLS] A [SEP] post-processor."""
    from tokenizers.processors import TemplateProcessing

    ids = {name: tok.token_to_id(t) for name, t in SPECIAL_TOKENS.items()}
    missing = [SPECIAL_TOKENS[n] for n, i in ids.items() if i is None]
    if missing:
        raise ValueError(f"tokenizer lacks special token(s) {', '.join(missing)}; train it with pretrain-tokenizer")
    tok.no_padding()
    tok.no_truncation()
    tok.post_processor = TemplateProcessing(
        single="[CLS] $A [SEP]",
        pair="[CLS] $A [SEP] $B:1 [SEP]:1",
        special_tokens=[("[CLS]", ids["cls"]), ("[SEP]", ids["sep"])],
    )
    return tok


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2) + "\n", encoding="utf-8")


def _write_tokenizer_files(tok, out: Path, model_max_length: int) -> None:
    tok.save(str(out / "tokenizer.json"))
    special = {f"{name}_token": t for name, t in SPECIAL_TOKENS.items()}
    _write_json(out / "special_tokens_map.json", special)
    _write_json(
        out / "tokenizer_config.json",
        {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": model_max_length, **special},
    )


def _write_sentence_transformers_files(
    out: Path, pooling: str, hidden: int, num_layers: int, max_seq_length: int, pooler: dict | None
) -> None:
    """modules.json + module configs: Transformer -> [WeightedLayerPooling] -> Pooling -> [Dense tanh]."""
    from safetensors.torch import save_file

    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}]
    st_config: dict = {"max_seq_length": max_seq_length, "do_lower_case": False}
    if pooling == "first_last_avg":  # (layer 1 + layer L)/2 per token: weights 1,0,...,0,1 from layer 1 on
        st_config["config_args"] = {"output_hidden_states": True}
        weights = torch.zeros(num_layers)
        weights[0] += 1.0
        weights[-1] += 1.0
        modules.append({"idx": 1, "name": "1", "path": "1_WeightedLayerPooling",
                        "type": "sentence_transformers.models.WeightedLayerPooling"})  # fmt: skip
        _write_json(
            out / "1_WeightedLayerPooling" / "config.json",
            {"word_embedding_dimension": hidden, "layer_start": 1, "num_hidden_layers": num_layers},
        )
        save_file({"layer_weights": weights}, str(out / "1_WeightedLayerPooling" / "model.safetensors"))
    n = len(modules)
    modules.append({"idx": n, "name": str(n), "path": f"{n}_Pooling", "type": "sentence_transformers.models.Pooling"})
    modes = dict.fromkeys(
        ("pooling_mode_cls_token", "pooling_mode_mean_tokens", "pooling_mode_max_tokens",
         "pooling_mode_mean_sqrt_len_tokens"), False
    )  # fmt: skip
    modes[_ST_POOLING_MODES[pooling]] = True
    _write_json(out / f"{n}_Pooling" / "config.json", {"word_embedding_dimension": hidden, **modes})
    if pooler is not None:  # "cls" through BERT's pooler = CLS token, then Dense + tanh
        modules.append({"idx": 2, "name": "2", "path": "2_Dense", "type": "sentence_transformers.models.Dense"})
        _write_json(
            out / "2_Dense" / "config.json",
            {"in_features": hidden, "out_features": hidden, "bias": True,
             "activation_function": "torch.nn.modules.activation.Tanh"},
        )  # fmt: skip
        save_file(pooler, str(out / "2_Dense" / "model.safetensors"), metadata={"format": "pt"})
    _write_json(out / "modules.json", modules)
    _write_json(out / "sentence_bert_config.json", st_config)
    _write_json(
        out / "config_sentence_transformers.json",
        {"__version__": {"pretrain": "0.1.0"}, "prompts": {}, "default_prompt_name": None,
         "similarity_fn_name": "cosine"},
    )  # fmt: skip


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu").contiguous().clone()


def export_hf(
    model: PretrainModel,
    tokenizer_path: str,
    out_dir: str,
    *,
    pooling: str,
    max_seq_length: int | None = None,
    overwrite: bool = False,
) -> None:
    """Write a HF BERT directory (+ sentence-transformers files) for ``model``.

    Written to a temporary sibling directory and renamed into place: ``out_dir`` is complete
    or absent. ``pooling`` is what SentenceTransformer(out_dir) will apply (any of POOLINGS;
    first_last_avg goes through sentence-transformers' WeightedLayerPooling).
    """
    import tokenizers
    from safetensors.torch import save_file

    cfg = model.cfg
    if cfg.norm != "post":
        raise ValueError("only post-LN models (model.norm=post) export to the HF BERT format; pre-LN has no BERT twin")
    if pooling not in _ST_POOLING_MODES:
        raise ValueError(
            f"pooling {pooling!r} cannot be expressed in sentence-transformers here; "
            f"export with one of {', '.join(_ST_POOLING_MODES)}"
        )
    if not os.path.isfile(tokenizer_path):
        raise FileNotFoundError(f"tokenizer file {tokenizer_path} not found; pass the run's data.tokenizer path")
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; remove it or pass overwrite=True (--overwrite)")
    tok = clean_tokenizer(tokenizers.Tokenizer.from_file(tokenizer_path))
    if tok.get_vocab_size(with_added_tokens=True) > cfg.vocab_size:
        raise ValueError(
            f"tokenizer {tokenizer_path} has {tok.get_vocab_size(with_added_tokens=True)} tokens but the model's "
            f"vocab_size is {cfg.vocab_size}; pass the tokenizer the model was trained with"
        )
    max_len = min(max_seq_length or cfg.max_position, cfg.max_position)
    ours = model.state_dict()
    hf = {k: _cpu_copy(v) for k, v in to_hf_state_dict(ours, cfg.num_layers).items()}
    projection = {k: _cpu_copy(v) for k, v in ours.items() if k.startswith(OURS_ONLY_PREFIXES)}
    pooler = None
    if pooling == "cls" and model.pooler is not None:
        pooler = {"linear.weight": hf["bert.pooler.dense.weight"].clone(),
                  "linear.bias": hf["bert.pooler.dense.bias"].clone()}  # fmt: skip
    hf_config = hf_config_from_model_config(cfg, tok)
    hf_config["torch_dtype"] = str(next(iter(hf.values())).dtype).removeprefix("torch.")

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(hf, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if projection:
            save_file(projection, str(tmp / PROJECTION_FILE), metadata={"format": "pt"})
        _write_json(tmp / "config.json", hf_config)
        _write_tokenizer_files(tok, tmp, max_len)
        _write_sentence_transformers_files(tmp, pooling, cfg.hidden_size, cfg.num_layers, max_len, pooler)
        os.chmod(tmp, 0o755)
        if out.exists():  # overwrite: move the old one aside first, so out_dir is never half-written
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
            os.replace(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# ----------------------------------------------------------------------------- import


def read_hf_weights(hf_dir: str | os.PathLike) -> dict:
    """All tensors of a HF checkpoint directory (model.safetensors, a sharded index, or pytorch_model.bin)."""
    from safetensors.torch import load_file

    d = Path(hf_dir)
    if (d / "model.safetensors").is_file():
        return load_file(str(d / "model.safetensors"))
    index = d / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        out: dict = {}
        for f in files:
            out.update(load_file(str(d / f)))
        return out
    if (d / "pytorch_model.bin").is_file():
        return torch.load(d / "pytorch_model.bin", map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no model.safetensors, model.safetensors.index.json or pytorch_model.bin in {d}")


def model_with_state(
    cfg: ModelConfig, state: dict, *, source: str, required_prefixes: tuple[str, ...] = ("encoder.",)
) -> PretrainModel:
    """PretrainModel(cfg) holding ``state`` (our names; tensors are taken over, not copied).

    Keys under ``required_prefixes`` must all be present (ValueError otherwise); missing MLM-head
    weights are freshly initialised with a warning, missing projection weights silently.
    """
    model = build_model(cfg, init=False)
    expected = model.state_dict()
    unexpected = sorted(set(state) - set(expected))
    missing = sorted(set(expected) - set(state) - set(TIED_KEYS))
    bad_shape = [k for k in state if k in expected and state[k].shape != expected[k].shape]
    if unexpected or bad_shape or any(k.startswith(required_prefixes) for k in missing):
        raise ValueError(
            f"{source} does not fit the model its config describes: missing {missing[:4]}, "
            f"unexpected {unexpected[:4]}, wrong shape {bad_shape[:4]}; is it a complete BERT/PretrainModel checkpoint?"
        )
    model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False, assign=True)
    model.tie_weights()
    for name in sorted({k.split(".")[0] for k in missing}):
        if name == "mlm_head":
            warnings.warn(f"{source} has no MLM head weights; the MLM head is freshly initialised", stacklevel=3)
        init_bert_weights(getattr(model, name), cfg.init_std)
    return model


def write_clean_tokenizer(hf_dir: str | os.PathLike, out_path: str | os.PathLike) -> str:
    """Write the HF directory's tokenizer as a plain tokenizer.json (no padding/truncation) to out_path."""
    import tokenizers

    d = Path(hf_dir)
    if (d / "tokenizer.json").is_file():
        tok = tokenizers.Tokenizer.from_file(str(d / "tokenizer.json"))
    else:  # e.g. only vocab.txt: let transformers build the fast tokenizer
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(d)).backend_tokenizer
    tok = clean_tokenizer(tok)
    Path(out_path).parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_path))
    return str(out_path)


# ----------------------------------------------------------------------------- our "init" directory

INIT_WEIGHTS = "model.safetensors"
INIT_CONFIG = "config.yaml"
INIT_TOKENIZER = "tokenizer.json"


def write_init_dir(model: PretrainModel, tokenizer_path: str, out_dir: str, *, overwrite: bool = False) -> None:
    """Write OUT/{model.safetensors (our key names), config.yaml (model: + data.tokenizer), tokenizer.json},
    a directory the trainer starts from with ``checkpoint.init_from=OUT``. Complete or absent."""
    import yaml
    from safetensors.torch import save_file

    from pretrain.config.loader import to_dict

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise ValueError(f"{out} already exists; remove it or pass overwrite=True (--overwrite)")
    state = {k: _cpu_copy(v) for k, v in model.state_dict().items() if k not in TIED_KEYS}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        save_file(state, str(tmp / INIT_WEIGHTS), metadata={"format": "pt"})
        shutil.copyfile(tokenizer_path, tmp / INIT_TOKENIZER)
        # Relative to the directory: a moved or copied init dir (or run's best/) still opens its own tokenizer.
        config = {"model": to_dict(model.cfg), "data": {"tokenizer": INIT_TOKENIZER}}
        (tmp / INIT_CONFIG).write_text(yaml.safe_dump(config, sort_keys=False), encoding="utf-8")
        os.chmod(tmp, 0o755)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def load_init_weights(path: str) -> dict:
    """State dict (our names, tied aliases filled in) from an init directory or its model.safetensors."""
    from safetensors.torch import load_file

    p = Path(path)
    f = p / INIT_WEIGHTS if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"{f} not found; create an init directory with `pretrain-convert from-hf HF_DIR OUT`")
    state = load_file(str(f))
    for alias, source in TIED_KEYS.items():
        if alias not in state and source in state:
            state[alias] = state[source]
    return state
