"""What a run builds before DeepSpeed starts, in one function shared by the trainer and ``pretrain-train
--dry-run`` (``prepare_run`` -> ``RunParts``): the config-only preflight, the tokenizer, the stage's training set
and loader, the model config (init_from's architecture, the tokenizer's vocabulary) and the module with its
objective (init_from's weights, RankCSE's teachers, SARCSE's frequencies)."""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass

import torch

from pretrain.config import RunConfig
from pretrain.data import sentences
from pretrain.data.datasets import build_dataset
from pretrain.data.loader import build_loader
from pretrain.export.resolve import open_weights, run_model_config
from pretrain.metrics.writer import print_progress
from pretrain.model import build_model
from pretrain.model.dropout import set_fast_dropout
from pretrain.model.flat import flatten_layers
from pretrain.model.modern import compile_band
from pretrain.objective import Context, Objective, TrainModule
from pretrain.prep.tokenizer import load_tokenizer
from pretrain.training import resources
from pretrain.training.evaluation import stsb_data_dir
from pretrain.training.resources import check_teacher_paths

HEAD_PREFIXES = ("projection.",)
"""Training-only heads that init_from re-initialises when the checkpoint's shape does not fit."""


def objective_resources(cfg: RunConfig, tokenizer, train_set) -> dict:
    """What the configured objective needs from outside the batch: RankCSE's teachers, SARCSE's frequencies."""
    out = {}
    if cfg.objective.rank_distill is not None:
        out["teachers"] = resources.load_teachers(cfg.objective.rank_distill, trust=cfg.checkpoint.trust)
    if cfg.objective.reconstruction is not None:
        sentences = train_set if cfg.data.stage == "sentences" else None  # counted once, not rebuilt
        out["token_freq_V"] = resources.resolve_token_freq(cfg.objective, cfg.data, tokenizer, sentences)
    return out


def preflight(cfg: RunConfig) -> None:
    """Config-only checks of paths later steps open (after the tokenizer, data and model): a wrong one fails in the
    first seconds."""
    if cfg.eval.stsb_every:
        stsb_data_dir(cfg.eval, cfg.distributed.zero_stage)
    if cfg.objective.rank_distill is not None:
        check_teacher_paths(cfg.objective.rank_distill.teachers)


def build_train_set(cfg: RunConfig, tokenizer):
    """The training set of data.stage: documents (pretraining) or single sentences (the SimCSE family)."""
    if cfg.data.stage == "sentences":
        return sentences.build_sentence_dataset(cfg.data, cfg.objective, tokenizer, seed=cfg.seed)
    return build_dataset(cfg.data, tokenizer, seed=cfg.seed, split="train")


def train_loader_builder(cfg: RunConfig):
    """``build_loader`` or the sentence stage's (same arguments) for data.stage."""
    return sentences.build_sentence_loader if cfg.data.stage == "sentences" else build_loader


@dataclass
class RunParts:
    """What a run is built from before DeepSpeed starts (``prepare_run``)."""

    cfg: RunConfig
    """The run config with the model config resolved (init_from's architecture, the tokenizer's vocabulary)."""
    tokenizer: object
    train_set: object
    valid_set: object | None
    module: TrainModule


def prepare_run(cfg: RunConfig, env) -> RunParts:
    """Checks and builds everything before DeepSpeed, in the order that fails fastest: config-only paths, the
    tokenizer, init_from's weights, the datasets (rank 0 first, building and caching the sample indexes; the
    others then memory-map them), the module with its objective. ``pretrain-train --dry-run`` and the trainer
    both start here."""
    preflight(cfg)
    tokenizer = load_tokenizer(cfg.data.tokenizer)
    init = open_init_weights(cfg)  # opened (and verified) once: its architecture now, its weights below
    cfg = dataclasses.replace(cfg, model=model_config(cfg, tokenizer, init))
    with main_rank_first(env):
        train_set = build_train_set(cfg, tokenizer)
        valid_set = build_dataset(cfg.data, tokenizer, seed=cfg.seed, split="valid") if cfg.data.valid else None
    module = build_train_module(cfg, env, tokenizer, train_set, init)
    return RunParts(cfg=cfg, tokenizer=tokenizer, train_set=train_set, valid_set=valid_set, module=module)


@contextlib.contextmanager
def main_rank_first(env):
    """Run the block on rank 0 first, then on the other ranks (which wait at a barrier meanwhile)."""
    if env.is_distributed and not env.is_main:
        torch.distributed.barrier()
    try:
        yield
    finally:
        if env.is_distributed and env.is_main:
            torch.distributed.barrier()


def open_init_weights(cfg: RunConfig):
    """checkpoint.init_from opened (``resolve.open_weights``), or None without one."""
    if not cfg.checkpoint.init_from:
        return None

    return open_weights(cfg.checkpoint.init_from, trust=cfg.checkpoint.trust)


def model_config(cfg: RunConfig, tokenizer, init):
    """The model a run builds: cfg.model with the architecture of the init_from weights ``init`` where the config
    does not set it (a contradicting setting is a ValueError naming both), and the tokenizer's vocabulary size
    when model.vocab_size is 0."""
    model_cfg = run_model_config(cfg, init)
    if model_cfg.vocab_size == 0:
        return dataclasses.replace(model_cfg, vocab_size=tokenizer.vocab_size)
    if model_cfg.vocab_size < tokenizer.vocab_size:
        raise ValueError(f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's vocabulary "
                         f"({tokenizer.vocab_size}, {cfg.data.tokenizer}); set model.vocab_size=0")
    return model_cfg


def build_train_module(cfg: RunConfig, env, tokenizer, train_set, init) -> TrainModule:
    """The model (cfg.model, from ``model_config``) with the init_from weights ``init`` loaded, and its objective.
    Initial weights (the model's and the objective's heads') are identical on every rank: drawn from the seed in a
    scoped RNG that leaves the process-global one alone."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = build_model(cfg.model)
        if init is not None:
            _load_init_weights(model, init, fresh_pooler=cfg.checkpoint.fresh_pooler)
        ctx = Context(env=env, ops=cfg.ops, pooling=cfg.model.pooling, stage=cfg.data.stage,
                      trim_last_layer=cfg.train.trim_last_layer, joint_pass=cfg.train.joint_pass)
        module = TrainModule(model, Objective(cfg.objective, ctx, **objective_resources(cfg, tokenizer, train_set)))
        set_fast_dropout(module, cfg.train.fast_dropout)
    if cfg.step_compiled:
        compile_band(model, max(cfg.data.max_len, cfg.data.view_max_len))
        module.compile_step(**compile_options(cfg.train))
    return module


def flat_params_apply(train, dist) -> bool:
    """Whether the run holds its encoder layers' parameters flat (train.flat_params; ZeRO-3 keeps them per
    tensor: it gathers and frees parameters per module, and would free the storage the views hold)."""
    return train.flat_params and dist.zero_stage < 3


def apply_param_layout(module: TrainModule, train, dist) -> None:
    """Flattens the encoder layers' parameters (model/flat.py) where ``flat_params_apply``; before DeepSpeed
    wraps the module, after any weights were loaded."""
    if flat_params_apply(train, dist):
        flatten_layers(module.model, train.flat_scope)


def compile_options(train) -> dict:
    """torch.compile's arguments from train.compile_backend, compile_mode and compile_shapes."""
    return {"backend": train.compile_backend, "mode": None if train.compile_mode == "default" else train.compile_mode,
            "dynamic": {"auto": None, "dynamic": True, "static": False, "bucketed": False}[train.compile_shapes]}


def _load_init_weights(model: torch.nn.Module, init, *, fresh_pooler: bool = False) -> None:
    """Initial weights from anything ``open_weights`` recognises (``init``): our checkpoints, a `pretrain-convert
    from-hf` directory, a HF or sentence-transformers BERT directory. ``fresh_pooler`` (checkpoint.fresh_pooler):
    the pooler keeps the model's fresh init."""
    state, path, fresh = init.state, init.path, []
    if fresh_pooler:
        if getattr(model, "pooler", None) is None:
            raise ValueError("checkpoint.fresh_pooler=true needs a pooler to start fresh: set model.pooler=true "
                             "(BERT), or drop checkpoint.fresh_pooler")
        fresh = [k for k in state if k.startswith("pooler.")]
        state = {k: v for k, v in state.items() if k not in fresh}
    # The contrastive projection head is a training-only head whose shape follows the recipe
    # (e.g. none in the SimCSE-style recipes, whose MLP is the pooler, vs CLEAR's 2 layers): when it does not fit, it
    # starts fresh (or is left out).
    own = model.state_dict()
    dropped = [k for k, v in state.items() if k.startswith(HEAD_PREFIXES)
               and (k not in own or own[k].shape != v.shape)]
    state = {k: v for k, v in state.items() if k not in dropped}
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatch
        raise ValueError(f"checkpoint.init_from={path} does not fit this model ({str(e).splitlines()[-1].strip()}); "
                         f"is it a checkpoint of another model size? Set model.* to match it.") from None
    if unexpected:
        raise ValueError(f"checkpoint.init_from={path} has weights this model does not: {unexpected[:5]}; "
                         f"is it a checkpoint of another model size?")
    if fresh:
        print_progress(f"init_from {path}: the pooler ({', '.join(fresh)}) starts fresh (checkpoint.fresh_pooler)")
    missing = [k for k in missing if k not in fresh]
    if missing:
        print_progress(f"init_from {path}: {len(missing)} tensors not in the checkpoint keep their fresh init "
                       f"(e.g. {missing[:3]})")
