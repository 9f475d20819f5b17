"""One way to open weights: whatever directory a user hands us -> ``Weights`` -> a ``PretrainModel``.

Recognised, in this order (the first match wins):

    sentence_transformers  config.json + modules.json (a sentence-transformers model, e.g. all-MiniLM-L6-v2; its
                           modules become model.pooling/pooler/dense_*/normalize: see st_modules)
    hf                     config.json (a Hugging Face BERT directory: its sentence embedding is ModelConfig's
                           default, pooling=cls through the pooler; ours from ``pretrain-convert to-hf`` too)
    checkpoint             a checkpoint tag (trainer_state.json; it holds model.safetensors + config.yaml too)
    init_dir               model.safetensors + config.yaml (``pretrain-convert from-hf``, ``<run_dir>/best/``)
    checkpoint             a run directory or its checkpoints/ (their newest complete tag; any ZeRO stage)

HF and init directories are read from safetensors (a HF directory with ``pytorch_model.bin`` only is refused);
our checkpoints from their model.safetensors (``store.load_model_state``, after checking the files against the
checkpoint's files.json: a damaged one is refused); an old checkpoint without it only with ``trust``. Used by
``checkpoint.init_from``, ``pretrain-convert``, RankCSE's teachers and evaluation, so that they all accept the
same inputs with the same errors. ``run_model_config`` gives ``checkpoint.init_from`` the architecture of what it
starts from. This module depends on ``export.hf`` (key maps, readers), never the other way round.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import tempfile
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pretrain.checkpoint.files import read_safetensors
from pretrain.checkpoint.store import (
    CheckpointError,
    checkpoints_dir,
    find_intact,
    is_complete,
    list_complete,
    load_heads_state,
    load_model_state,
    read_trainer_state,
    resolve_tag_dir,
    tag_for_step,
)
from pretrain.config.loader import from_dict
from pretrain.config.model import ModelConfig
from pretrain.export import hf_modern, hf_roberta
from pretrain.export.hf import (
    CONFIG_JSON_FIELDS,
    INIT_CONFIG,
    INIT_FIX,
    INIT_TOKENIZER,
    INIT_WEIGHTS,
    PROJECTION_FILE,
    from_hf_state_dict,
    hf_family,
    load_init_weights,
    model_config_from_hf_config,
    model_with_state,
    untied_decoder,
)
from pretrain.export.hf_tokenizer import write_clean_tokenizer
from pretrain.export.hf_weights import read_hf_weights
from pretrain.export.st_modules import SENTENCE_FIELDS, read_st_modules
from pretrain.fsutil import inside
from pretrain.model.autoencoder import HEADS_FILE
from pretrain.prep.tokenizer import load_tokenizer

Kind = Literal["sentence_transformers", "hf", "init_dir", "checkpoint"]

LOOKED_FOR = ("config.json (a Hugging Face / sentence-transformers model), model.safetensors + config.yaml "
              "(a pretrain-convert from-hf directory), or trainer_state.json in it, its checkpoints/ and their "
              "'latest' (one of our checkpoints)")


@dataclass
class Weights:
    """Weights in our key names with the architecture they describe."""

    kind: Kind
    path: Path
    state: dict
    """Our parameter names -> tensors (fp32 for our checkpoints; as stored otherwise)."""
    model_cfg: ModelConfig
    """The architecture: from our run config, or from config.json; vocab_size from the embedding matrix."""
    tokenizer_path: str | None = None
    """A tokenizer.json ours opens as it is (checkpoints and init dirs); None for HF dirs (see load_tokenizer)."""
    run_config: dict = field(default_factory=dict)
    """Our resolved run config (checkpoints and init dirs); {} for HF dirs."""
    st_modules: list | None = None
    """sentence-transformers' modules.json entries (kind sentence_transformers), e.g. its pooling."""
    recorded: frozenset = frozenset()
    """The ModelConfig fields the source states; the others in model_cfg are ModelConfig defaults (a plain HF
    BERT states no pooling, say). What ``checkpoint.init_from`` takes over (see init_model_config)."""
    max_seq_length: int | None = None
    """The sequence length the source was used with (sentence-transformers' max_seq_length), if it says."""
    heads: dict = field(default_factory=dict)
    """The objective's trainable heads (``heads.*``: SARCSE's autoencoder) of a checkpoint or init dir; {} else."""

    def build_model(self, *, warn_fresh_head: bool = True):
        """A PretrainModel holding these weights (encoder weights required, heads filled in when absent)."""
        required = ("",) if self.kind == "checkpoint" else ("encoder.",)
        return model_with_state(self.model_cfg, self.state, source=str(self.path), required_prefixes=required,
                                warn_fresh_head=warn_fresh_head)

    def load_tokenizer(self, out_path: str | None = None):
        """Our Tokenizer for these weights. HF directories: their tokenizer re-saved as a clean tokenizer.json at
        ``out_path`` (default: in a new temporary directory, kept: the Tokenizer re-opens its file by path)."""
        if self.kind in ("hf", "sentence_transformers"):

            if out_path is None:
                return load_tokenizer(_cached_clean_tokenizer(self.path))
            return load_tokenizer(write_clean_tokenizer(self.path, out_path))
        if not self.tokenizer_path or not Path(self.tokenizer_path).is_file():
            raise FileNotFoundError(f"{self.path} names tokenizer {self.tokenizer_path!r}, which is missing; "
                                    "convert it with pretrain-convert or keep the run directory intact")
        return load_tokenizer(self.tokenizer_path)


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "merges.txt", "special_tokens_map.json",
                   "sentence_bert_config.json")
"""The files that decide a HF directory's tokenization (sentence_bert_config.json: do_lower_case)."""


def _cached_clean_tokenizer(hf_dir: Path) -> str:
    """The HF directory's tokenizer re-saved as a clean tokenizer.json in a per-user cache keyed by the sha256 of
    its tokenizer files (one file per distinct tokenizer, reused; before, every opening left a new temporary
    directory behind). Falls back to a temporary directory when the cache is not writable."""
    import hashlib


    digest = hashlib.sha256()
    for name in TOKENIZER_FILES:
        if (hf_dir / name).is_file():
            digest.update(name.encode() + b"\0" + (hf_dir / name).read_bytes())
    root = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pretrain" / "hf-tokenizers"
    path = root / digest.hexdigest()[:24] / "tokenizer.json"
    if path.is_file():
        return str(path)
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=root))
        try:  # written aside, then renamed: concurrent openers never read half a file
            write_clean_tokenizer(hf_dir, tmp / "tokenizer.json")
            path.parent.mkdir(exist_ok=True)
            os.replace(tmp / "tokenizer.json", path)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError:
        return write_clean_tokenizer(hf_dir, os.path.join(tempfile.mkdtemp(prefix="pretrain-hf-tokenizer-"),
                                                          "tokenizer.json"))
    return str(path)


def detect_kind(path: str | os.PathLike) -> Kind:
    """What ``path`` is (see the module docstring), or FileNotFoundError/ValueError naming what was looked for."""
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p} does not exist; expected {LOOKED_FOR}")
    if p.is_dir() and (p / "config.json").is_file():
        return "sentence_transformers" if (p / "modules.json").is_file() else "hf"
    if is_complete(p):  # a checkpoint tag holds model.safetensors + config.yaml too: it is verified as one
        return "checkpoint"
    if p.is_dir() and (p / INIT_WEIGHTS).is_file() and (p / INIT_CONFIG).is_file():
        return "init_dir"
    try:
        resolve_tag_dir(p)
    except (FileNotFoundError, ValueError, OSError):
        raise ValueError(f"{p} is not a model directory pretrain can open: found none of {LOOKED_FOR}") from None
    return "checkpoint"


def open_weights(path: str | os.PathLike, *, trust: bool = False) -> Weights:
    """``Weights`` of any recognised directory (see the module docstring); ``trust`` allows unpickling an old
    checkpoint of ours that has no model.safetensors."""
    p = Path(path)
    kind = detect_kind(p)
    if kind in ("hf", "sentence_transformers"):
        return _open_hf(p, kind)
    if kind == "init_dir":
        return _open_init_dir(p)
    return _open_checkpoint(p, trust)


def _model_cfg(model_dict: dict, state: dict, where: Path) -> tuple[ModelConfig, frozenset]:
    """(ModelConfig, the fields stated) from a config.yaml's model: block and the weights."""
    cfg = from_dict(ModelConfig, dict(model_dict or {}), "model")
    word = state.get("encoder.embeddings.word.weight")
    if word is None:
        raise ValueError(f"{where} has no encoder.embeddings.word.weight; is it a complete PretrainModel checkpoint?")
    cfg = dataclasses.replace(cfg, vocab_size=word.shape[0], pooler="pooler.dense.weight" in state)
    return cfg, frozenset(model_dict or {}) | {"vocab_size", "pooler"}


def _open_checkpoint(p: Path, trust: bool) -> Weights:
    state, config = load_model_state(p, trust=trust)
    cfg, recorded = _model_cfg(config.get("model"), state, p)
    return Weights("checkpoint", p, state, cfg, tokenizer_path=(config.get("data") or {}).get("tokenizer") or None,
                   run_config=config, recorded=recorded, max_seq_length=(config.get("data") or {}).get("max_len"),
                   heads=load_heads_state(p, trust=trust))


def _open_init_dir(p: Path) -> Weights:
    import yaml


    config = yaml.safe_load((p / INIT_CONFIG).read_text(encoding="utf-8")) or {}
    state = load_init_weights(str(p))
    tok = _own_tokenizer(p, (config.get("data") or {}).get("tokenizer"), INIT_TOKENIZER)
    config.setdefault("data", {})["tokenizer"] = tok  # consumers of run_config get the resolved path too
    cfg, recorded = _model_cfg(config.get("model"), state, p)
    heads = read_safetensors(p / HEADS_FILE, fix=INIT_FIX) if (p / HEADS_FILE).is_file() else {}
    return Weights("init_dir", p, state, cfg, tokenizer_path=tok, run_config=config, recorded=recorded,
                   max_seq_length=config["data"].get("max_len"), heads=heads)


def _own_tokenizer(directory: Path, named: str | None, default: str) -> str:
    """The tokenizer an init dir means: its own copy when it holds one (older ones recorded an absolute path,
    wrong once the directory moves), else the recorded path, relative to the directory; a relative path that
    leaves the directory is refused."""
    if (directory / default).is_file() or not named:
        return str(directory / default)
    if os.path.isabs(named):
        return named
    resolved = (directory / named).resolve()
    if not resolved.is_relative_to(directory.resolve()):
        raise ValueError(f"{directory}/config.yaml names tokenizer {named!r}, outside the directory; refusing it")
    return str(resolved)


def _open_hf(p: Path, kind: Kind) -> Weights:
    config = json.loads((p / "config.json").read_text(encoding="utf-8"))
    extra = config.get("pretrain") or {}  # our own exports: the settings BERT's config.json has no place for
    cfg = model_config_from_hf_config(config)
    family = hf_family(cfg)
    hf_state = read_hf_weights(p)
    mlm = str(extra.get("mlm_head") or "")
    if mlm and (inside(p, mlm, listed_in="config.json") / "model.safetensors").is_file():  # our export's MLM copy
        head = {"modernbert": hf_modern.HEAD_PREFIXES, "bert": ("cls.",)}.get(family, hf_roberta.HEAD_PREFIXES)
        hf_state.update(read_safetensors(p / mlm / "model.safetensors", keep=lambda k: k.startswith(head)))
    if untied_decoder(hf_state, family):
        warnings.warn(f"{p}: its MLM decoder is not tied to its word embeddings (tie_word_embeddings=false); "
                      f"pretrain's MLM head always is, so its decoder weights are left out and its MLM logits "
                      f"will differ from the source's (the encoder and sentence embeddings are unchanged)",
                      stacklevel=3)
    state = from_hf_state_dict(hf_state, cfg.num_layers, family)
    if family in hf_roberta.FAMILIES:
        state = hf_roberta.drop_leading_rows(state, config, cfg)
    if extra.get("pooler") is False:  # BertModel always has a pooler: ours wrote zeros for a model without one
        state = {k: v for k, v in state.items() if not k.startswith("pooler.")}
    if (p / PROJECTION_FILE).is_file():
        state.update(read_safetensors(p / PROJECTION_FILE))
    stated = hf_modern.CONFIG_JSON_FIELDS if cfg.arch == "modernbert" else CONFIG_JSON_FIELDS
    recorded = set(stated) | set(extra) & {f.name for f in dataclasses.fields(ModelConfig)} | {"pooler"}
    cfg = dataclasses.replace(cfg, pooler="pooler.dense.weight" in state)
    modules, max_len = None, None
    if kind == "sentence_transformers":
        modules = json.loads((p / "modules.json").read_text(encoding="utf-8"))
        if not isinstance(modules, list):
            raise ValueError(f"{p / 'modules.json'} is not a list of modules; is it a sentence-transformers model?")
        st = read_st_modules(p, modules, num_layers=cfg.num_layers, hidden=cfg.hidden_size, state=state,
                             recorded_pooling=extra.get("pooling"))
        cfg = dataclasses.replace(cfg, **st.fields)
        state.update(st.state)
        recorded |= set(SENTENCE_FIELDS)
        max_len = st.max_seq_length
    return Weights(kind, p, state, cfg, st_modules=modules, recorded=frozenset(recorded), max_seq_length=max_len)


def open_hf_dir(hf_dir: str | os.PathLike) -> Weights:
    """``Weights`` of a Hugging Face (or sentence-transformers) BERT directory; FileNotFoundError otherwise."""
    d = Path(hf_dir)
    if not d.exists():
        raise FileNotFoundError(f"{d} does not exist; pass a Hugging Face BERT model directory")
    if not (d / "config.json").is_file():
        raise FileNotFoundError(f"{d} has no config.json; pass a Hugging Face BERT model directory")
    return _open_hf(d, detect_kind(d))


def load_hf_model(hf_dir: str | os.PathLike):
    """HF BERT directory -> PretrainModel in fp32. Without MLM head weights the head is freshly
    initialised (warned); without pooler weights the model has no pooler (cfg.pooler=False).

    The sentence embedding: a sentence-transformers model's modules (st_modules: pooling, Dense, Normalize);
    a plain transformers BERT states none, so it gets ModelConfig's defaults: model.pooling=cls (through
    BERT's pooler when the weights have one, as BERT's pooler_output), no Dense, no normalisation."""
    return open_hf_dir(hf_dir).build_model()


def load_hf(hf_dir: str, *, tokenizer_out: str | None = None):
    """HF BERT directory -> (PretrainModel, Tokenizer); the tokenizer re-saved as a clean tokenizer.json at
    ``tokenizer_out`` (default: a new temporary directory, kept: our Tokenizer re-opens its file by path)."""
    w = open_hf_dir(hf_dir)
    return w.build_model(), w.load_tokenizer(tokenizer_out)


# ----------------------------------------------------------------------------- checkpoint.init_from

ARCHITECTURE_FIELDS = ("arch", "local_window", "global_every", "rope_theta", "rope_theta_local", "vocab_size", "hidden_size", "num_layers", "num_heads", "ffn_size", "max_position", "position_offset",
                       "type_vocab_size", "layer_norm_eps", "norm", "activation", "pooler", "pooling", "normalize",
                       "dense_dim", "dense_activation", "dense_bias")
"""model.* settings ``checkpoint.init_from`` takes from the weights it starts from (the shapes, and what a
sentence embedding is). Dropout, init and the training-only projection head stay the run's."""


def init_model_config(model_cfg: ModelConfig, weights: Weights, *, given=frozenset(), source: str = "") -> ModelConfig:
    """``model_cfg`` with every architecture field the weights state, unless the config sets it (``given``: the
    dotted keys the YAML files and overrides set, e.g. "model.hidden_size"); a set value that differs from the
    weights' is a ValueError naming both (model.vocab_size=0, "from the tokenizer", counts as unset)."""
    updates, conflicts, theirs_all = {}, [], []
    for name in ARCHITECTURE_FIELDS:
        if name not in weights.recorded:
            continue
        ours, theirs = getattr(model_cfg, name), getattr(weights.model_cfg, name)
        if f"model.{name}" in given and not (name == "vocab_size" and ours == 0):
            if ours != theirs:
                conflicts.append(f"model.{name}={ours!r} in the config, {theirs!r} in the checkpoint")
                theirs_all.append(f"model.{name}={theirs}")
        elif ours != theirs:
            updates[name] = theirs
    if conflicts:
        raise ValueError(
            f"checkpoint.init_from={source or weights.path} does not fit this model: {'; '.join(conflicts)}. Is it "
            f"a checkpoint of another model size? Without these model.* settings the run takes the checkpoint's; "
            f"where the config sets them (a recipe's size preset, model=...), give the checkpoint's on the command "
            f"line instead: {' '.join(theirs_all)}")
    return dataclasses.replace(model_cfg, **updates) if updates else model_cfg


def run_model_config(cfg, weights: Weights | None = None) -> ModelConfig:
    """The model a run builds: ``cfg.model`` (a RunConfig's), with ``checkpoint.init_from``'s architecture where
    the config does not set it (init_model_config). Without init_from: cfg.model. ``weights``: init_from already
    opened (the trainer loads them next), else it is opened here."""
    if not cfg.checkpoint.init_from:
        return cfg.model
    w = weights or open_weights(cfg.checkpoint.init_from, trust=cfg.checkpoint.trust)
    return init_model_config(cfg.model, w, given=cfg.given, source=cfg.checkpoint.init_from)


# ----------------------------------------------------------------------------- which checkpoint a reader uses

CHECKPOINT_CHOICES = "latest|best|step_N"


def select_checkpoint(path: str | os.PathLike, which: str = "latest", *, say=print) -> tuple[Path, str]:
    """(the directory to open, one line naming it) for a reader's ``--checkpoint latest|best|step_N``.

    A run directory: ``latest`` = its newest complete checkpoint that verifies (as a resume takes: newer damaged
    ones are skipped with one warning line through ``say``; CheckpointError when none verifies), ``best`` =
    ``<run>/best/`` (the best STS-B dev weights, kept by eval.stsb_every), ``step_N`` = ``checkpoints/step_N`` (N
    as a number or the tag; refused when read if damaged). The line gives the tag and step, and mentions best/ when
    it exists and is another step. Any other directory (a tag, an init or HF directory) is read as it is, with
    ``latest`` only. FileNotFoundError/ValueError say what exists."""

    p = Path(path)
    which = (which or "latest").strip()
    if which not in ("latest", "best") and not _STEP_RE.match(which):
        raise ValueError(f"--checkpoint {which!r}: expected {CHECKPOINT_CHOICES} (e.g. step_600)")
    is_run = p.is_dir() and (checkpoints_dir(p).is_dir() or (p / "best").is_dir()) and not is_complete(p)
    if not is_run:
        if which != "latest":
            raise ValueError(f"--checkpoint {which} needs a run directory (holding checkpoints/ or best/); {p} is "
                             f"not one: pass the run directory, or drop --checkpoint to read {p} itself")
        if p.exists() and is_complete(p):
            return p, f"reading checkpoint {p.name} (step {read_trainer_state(p).get('step')}) at {p}"
        return p, f"reading {p} ({describe_weights_dir(p)})"
    best = best_record(p)
    tags = list_complete(checkpoints_dir(p))
    if which == "best":
        if best is None:
            raise FileNotFoundError(f"{p} has no best/ (it is written by eval.stsb_every with eval.keep_best); "
                                    f"its checkpoints: {', '.join(tags) or 'none'}")
        return p / "best", f"reading {p}/best (step {best.get('step')}, STS-B dev {format_best_score(best)})"
    if which == "latest":
        tag_dir, skipped = _newest_intact(p, say)
        label = "the latest intact" if skipped else "the latest"
    else:
        tag = tag_for_step(int(_STEP_RE.match(which).group(1)))
        tag_dir = checkpoints_dir(p) / tag
        if not is_complete(tag_dir):
            raise FileNotFoundError(f"{p} has no complete checkpoint {tag}; it has: {', '.join(tags) or 'none'}"
                                    + (" and best/" if best else ""))
        label = "as asked"
    step = read_trainer_state(tag_dir).get("step")
    line = f"reading checkpoint {tag_dir.name} (step {step}, {label}) of {p}"
    if best is not None and best.get("step") != step:
        line += (f"; best/ is step {best.get('step')} (STS-B dev {format_best_score(best)}): --checkpoint best reads it")
    return tag_dir, line


_STEP_RE = re.compile(r"^(?:step_)?(\d+)$")


def _newest_intact(run_dir: Path, say) -> tuple[Path, bool]:
    """(the tag dir of the run's newest checkpoint that verifies, whether newer damaged ones were skipped); those
    are named in one warning line. CheckpointError when every checkpoint is damaged; FileNotFoundError (from
    resolve_tag_dir) when there is none."""
    ckpt_dir = checkpoints_dir(run_dir)
    tag, damaged = find_intact(ckpt_dir)
    named = "; ".join(f"{t} ({', '.join(problems)})" for t, problems in damaged.items())
    if tag is None and damaged:
        raise CheckpointError(f"every checkpoint of {run_dir} is damaged: {named}. pretrain-train --check {run_dir} "
                              f"lists them; read best/ (--checkpoint best) if the run has one")
    if tag is None:
        return resolve_tag_dir(run_dir), False  # raises, saying what was looked for
    if damaged:
        say(f"warning: skipping damaged checkpoint{'s' if len(damaged) > 1 else ''} of {ckpt_dir}: {named}; "
            f"reading {tag}, the newest that verifies (as a resume would)")
    return ckpt_dir / tag, bool(damaged)


def best_record(run_dir: Path) -> dict | None:
    """<run_dir>/best/best.json ({"step", "stsb_dev_spearman", "pooling"}), or None without best/."""
    best_json = run_dir / "best" / "best.json"
    if not best_json.is_file():
        return None
    try:
        return json.loads(best_json.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return {"step": "?"}


def format_best_score(best: dict) -> str:
    score = best.get("stsb_dev_spearman")
    return f"{score:.2f}" if isinstance(score, (int, float)) else "?"


def describe_weights_dir(p: Path) -> str:
    """What a non-run directory is, for the reader's line: an init dir (best/, from-hf) with its step if known,
    or a Hugging Face / sentence-transformers model."""
    try:
        kind = detect_kind(p)
    except (FileNotFoundError, ValueError):
        return "unrecognised"
    if kind == "init_dir":
        best = json.loads((p / "best.json").read_text()) if (p / "best.json").is_file() else None
        return f"weights directory, step {best.get('step')}" if best else "weights directory"
    return {"hf": "a Hugging Face model", "sentence_transformers": "a sentence-transformers model"}.get(kind, kind)
