"""sentence-transformers modules <-> our sentence-embedding settings, both ways, without loss.

    Transformer -> [WeightedLayerPooling] -> Pooling -> [Dense = BERT's pooler] -> [Dense] -> [Normalize]

maps onto ``model.pooling`` (cls / cls_before_pooler / mean / first_last_avg), ``model.pooler``,
``model.dense_*`` (PretrainModel.sentence_dense) and ``model.normalize``:

    Pooling(cls) + Dense(tanh, D->D, the BERT pooler's weights)   <->  pooling=cls with the pooler
    Pooling(cls)                                                  <->  cls_before_pooler (or cls without a pooler)
    Pooling(mean)                                                 <->  mean
    WeightedLayerPooling(layer 1 and layer L) + Pooling(mean)     <->  first_last_avg
    another Dense                                                 <->  dense_dim/dense_activation/dense_bias
    Normalize                                                     <->  normalize=true

Written in the legacy config format (``pooling_mode_*_tokens``, ``word_embedding_dimension``) that
sentence-transformers 2.2 through 6.x read; read in both that and the 6.x format. Anything without a
counterpart here (max pooling, several Dense layers, other modules) is a ValueError naming it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from pretrain.checkpoint.files import read_safetensors, save_safetensors, write_json
from pretrain.config.model import ModelConfig
from pretrain.export.hf_weights import refuse_pickled_weights
from pretrain.fsutil import inside

ST_POOLING = {"cls": "cls", "cls_before_pooler": "cls", "mean": "mean", "first_last_avg": "mean"}
"""Our pooling -> sentence-transformers' Pooling mode."""
ACTIVATION_PATHS = {"tanh": "torch.nn.modules.activation.Tanh", "identity": "torch.nn.modules.linear.Identity",
                    "relu": "torch.nn.modules.activation.ReLU", "gelu": "torch.nn.modules.activation.GELU"}
_ACTIVATION_NAMES = {path.rsplit(".", 1)[-1]: ours for ours, path in ACTIVATION_PATHS.items()}
_LEGACY_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_max_tokens": "max", "pooling_mode_mean_tokens": "mean",
                 "pooling_mode_mean_sqrt_len_tokens": "mean_sqrt_len_tokens",
                 "pooling_mode_weightedmean_tokens": "weightedmean", "pooling_mode_lasttoken": "lasttoken"}
SENTENCE_FIELDS = ("pooling", "normalize", "dense_dim", "dense_activation", "dense_bias")
"""The ModelConfig fields a sentence-transformers model states (with ``pooler``, from the weights)."""
ST_TYPE = "sentence_transformers.models."


# ----------------------------------------------------------------------------- write


def write_st_modules(out: Path, cfg: ModelConfig, pooling: str, state: dict, max_seq_length: int) -> list[str]:
    """modules.json + each module's files for a model whose sentence embedding is ``pooling`` (+ cfg's pooler,
    Dense, Normalize); ``state`` holds our (CPU) weights. Returns the module chain's names, for the model card."""
    if pooling not in ST_POOLING:
        raise ValueError(f"pooling {pooling!r} cannot be expressed in sentence-transformers here; "
                         f"export with one of {', '.join(ST_POOLING)}")
    hidden, modules = cfg.hidden_size, []

    def add(kind: str, files: dict | None = None, weights: dict | None = None) -> None:
        n = len(modules)
        path = "" if kind == "Transformer" else f"{n}_{kind}"
        modules.append({"idx": n, "name": str(n), "path": path, "type": ST_TYPE + kind})
        if files is not None:
            write_json(out / path / "config.json", files)
        if weights is not None:
            save_safetensors(weights, out / path / "model.safetensors", metadata={"format": "pt"})

    st_config: dict = {"max_seq_length": max_seq_length, "do_lower_case": False}
    add("Transformer")
    if pooling == "first_last_avg":  # (layer 1 + layer L)/2 per token: weights 1,0,...,0,1 from layer 1 on
        st_config["config_args"] = {"output_hidden_states": True}
        weights = torch.zeros(cfg.num_layers)
        weights[0] += 1.0
        weights[-1] += 1.0
        add("WeightedLayerPooling", {"word_embedding_dimension": hidden, "layer_start": 1,
                                     "num_hidden_layers": cfg.num_layers}, {"layer_weights": weights})
    modes = {key: False for key in list(_LEGACY_MODES)[:4]}
    modes[f"pooling_mode_{ST_POOLING[pooling]}_{'token' if ST_POOLING[pooling] == 'cls' else 'tokens'}"] = True
    add("Pooling", {"word_embedding_dimension": hidden, **modes})
    if pooling == "cls" and cfg.pooler:  # "cls" through BERT's pooler = the CLS token, then Dense + tanh
        add("Dense", _dense_config(hidden, hidden, True, "tanh"),
            {"linear.weight": state["pooler.dense.weight"].clone(), "linear.bias": state["pooler.dense.bias"].clone()})
    if cfg.dense_dim:
        add("Dense", _dense_config(hidden, cfg.dense_dim, cfg.dense_bias, cfg.dense_activation),
            {k.removeprefix("sentence_dense."): state[k].clone() for k in state if k.startswith("sentence_dense.")})
    if cfg.normalize:
        add("Normalize")  # no files: sentence-transformers builds it from the type alone
    write_json(out / "modules.json", modules)
    write_json(out / "sentence_bert_config.json", st_config)
    write_json(out / "config_sentence_transformers.json",
                {"__version__": {"pretrain": "0.1.0"}, "prompts": {}, "default_prompt_name": None,
                 "similarity_fn_name": "cosine"})
    return [m["type"].rsplit(".", 1)[-1] for m in modules]


def _dense_config(in_features: int, out_features: int, bias: bool, activation: str) -> dict:
    return {"in_features": in_features, "out_features": out_features, "bias": bias,
            "activation_function": ACTIVATION_PATHS[activation]}


# ----------------------------------------------------------------------------- read


@dataclass
class SentenceModules:
    """What a sentence-transformers model's modules say, in our terms."""

    fields: dict
    """ModelConfig fields: pooling, normalize, dense_dim, dense_activation, dense_bias."""
    state: dict = field(default_factory=dict)
    """Weights in our names (sentence_dense.*)."""
    max_seq_length: int | None = None
    chain: list[str] = field(default_factory=list)
    """The module types in order, e.g. ['Transformer', 'Pooling', 'Normalize']."""


def _module_weights(d: Path) -> dict:
    """A module directory's model.safetensors (a damaged one is a ValueError naming it; a pickle is refused)."""
    if (d / "model.safetensors").is_file():
        return read_safetensors(d / "model.safetensors")
    refuse_pickled_weights(d, "sentence-transformers")
    raise FileNotFoundError(f"{d} holds no model.safetensors")


def _read_json(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def _pooling_modes(cfg: dict) -> list[str]:
    if "pooling_mode" in cfg:  # sentence-transformers >= 6
        mode = cfg["pooling_mode"]
        return [mode] if isinstance(mode, str) else list(mode)
    return [mode for key, mode in _LEGACY_MODES.items() if cfg.get(key)] or ["mean"]  # its default


def read_st_modules(d: Path, modules: list, *, num_layers: int, hidden: int, state: dict,
                    recorded_pooling: str | None = None) -> SentenceModules:
    """Map the modules of the sentence-transformers model in ``d`` onto our settings; ``state`` (our names) is
    the BERT weights, to tell BERT's pooler from another Dense. ``recorded_pooling`` (config.json's "pretrain"
    block, our own exports) picks between two names of one computation (cls without a pooler)."""
    where = d / "modules.json"
    entries = sorted(modules, key=lambda m: int(m.get("idx", 0)))
    for m in entries:  # each module's files are the directory's own (a path read from the file)
        inside(d, str(m.get("path", "")), listed_in="modules.json")
    chain = [str(m.get("type", "")).rsplit(".", 1)[-1] for m in entries]
    if not chain or chain[0] != "Transformer" or entries[0].get("path", "") not in ("", "."):
        raise ValueError(f"{where}: expected the Transformer module first, stored in the directory itself "
                         f"(path ''); found {chain[:1]} at {entries[0].get('path') if entries else None!r}")
    fields: dict = {"normalize": False, "dense_dim": 0}
    out = SentenceModules(fields, chain=chain)
    st_config = _read_json(d / "sentence_bert_config.json")
    out.max_seq_length = st_config.get("max_seq_length")
    rest = list(zip(chain[1:], entries[1:]))
    layer_pooling = False
    if rest and rest[0][0] == "WeightedLayerPooling":
        layer_pooling = _first_last_weights(d / rest.pop(0)[1]["path"], num_layers, where)
    if not rest or rest[0][0] != "Pooling":
        raise ValueError(f"{where}: expected a Pooling module after the Transformer, found {chain[1:]}; only "
                         f"sentence embedding models (Transformer -> Pooling -> ...) convert")
    modes = _pooling_modes(_read_json(d / rest.pop(0)[1]["path"] / "config.json"))
    if len(modes) != 1 or modes[0] not in ("cls", "mean") or (layer_pooling and modes[0] != "mean"):
        raise ValueError(f"{where}: pooling mode {'+'.join(modes)}{' after WeightedLayerPooling' * layer_pooling} "
                         f"has no counterpart in pretrain (model.pooling: cls, cls_before_pooler, mean, "
                         f"first_last_avg)")
    pooling = "first_last_avg" if layer_pooling else ("cls_before_pooler" if modes[0] == "cls" else "mean")
    dense = [(entry, _read_json(d / entry["path"] / "config.json")) for kind, entry in rest if kind == "Dense"]
    if pooling == "cls_before_pooler" and dense and _is_bert_pooler(d / dense[0][0]["path"], dense[0][1], state):
        pooling = "cls"
        dense.pop(0)
    if len(dense) > 1:
        raise ValueError(f"{where}: {len(dense)} Dense modules after pooling; pretrain models carry one "
                         f"(model.dense_dim) besides BERT's pooler")
    if dense:
        entry, cfg = dense[0]
        act = _ACTIVATION_NAMES.get(str(cfg.get("activation_function", "torch.nn.modules.activation.Tanh"))
                                    .rsplit(".", 1)[-1])
        if act is None or cfg.get("use_residual") or cfg.get("in_features") != hidden or \
                cfg.get("module_input_name", "sentence_embedding") != "sentence_embedding":
            raise ValueError(f"{where}: Dense module {entry['path']} ({cfg}) has no counterpart in pretrain "
                             f"(model.dense_*: input = the pooled {hidden}-d embedding, activation one of "
                             f"{', '.join(ACTIVATION_PATHS)}, no residual)")
        fields.update(dense_dim=int(cfg["out_features"]), dense_activation=act, dense_bias=bool(cfg.get("bias", True)))
        out.state = {f"sentence_dense.{k}": v for k, v in _module_weights(d / entry["path"]).items()}
    tail = [kind for kind, _ in rest if kind != "Dense"]
    if tail not in ([], ["Normalize"]) or (tail and chain[-1] != "Normalize"):
        raise ValueError(f"{where}: modules {chain} have no counterpart in pretrain (after Pooling: Dense "
                         f"modules, then an optional Normalize, nothing else)")
    fields["normalize"] = bool(tail)
    if pooling == "cls_before_pooler" and recorded_pooling == "cls" and "pooler.dense.weight" not in state:
        pooling = "cls"  # without a pooler, "cls" is the CLS token too: keep the name the run used
    fields["pooling"] = pooling
    return out


def _first_last_weights(d: Path, num_layers: int, where: Path) -> bool:
    cfg = _read_json(d / "config.json")
    weights = _module_weights(d).get("layer_weights")
    expected = torch.zeros(num_layers)
    expected[0] += 1.0
    expected[-1] += 1.0
    if cfg.get("layer_start") != 1 or weights is None or not torch.equal(weights.float(), expected):
        raise ValueError(f"{where}: WeightedLayerPooling other than layers 1 and {num_layers} averaged "
                         f"(first_last_avg) has no counterpart in pretrain")
    return True


def _is_bert_pooler(d: Path, cfg: dict, state: dict) -> bool:
    """A Dense(tanh, D->D) whose weights are BERT's pooler: the pooler itself, as our exports write it."""
    if "pooler.dense.weight" not in state or not str(cfg.get("activation_function", "")).endswith(".Tanh"):
        return False
    w = _module_weights(d)
    return (cfg.get("bias", True) and w.get("linear.weight") is not None and w.get("linear.bias") is not None
            and torch.equal(w["linear.weight"], state["pooler.dense.weight"])
            and torch.equal(w["linear.bias"], state["pooler.dense.bias"]))
