"""Typed configs: dataclass trees loaded from YAML with dotted overrides."""

import sys

from pretrain.config.data import AugmentConfig, DataConfig, MaskingConfig, SourceConfig
from pretrain.config.loader import (
    apply_overrides,
    from_dict,
    load,
    read_yaml,
    to_dict,
    to_yaml,
)
from pretrain.config.model import ModelConfig
from pretrain.config.objective import ObjectiveConfig
from pretrain.config.run import RunConfig
from pretrain.config.train import (
    CheckpointConfig,
    DistributedConfig,
    EvalConfig,
    OpsConfig,
    OptimConfig,
    SpikeConfig,
    TrainConfig,
    resolve_precision,
)


def load_run_config(path=None, overrides=None) -> RunConfig:
    """configs/*.yaml + ['optim.lr=3e-4', ...] -> RunConfig (strict), with ``train.precision=auto`` resolved: on a
    CPU resuming a run, the precision its checkpoints were trained in (``run_precision``), else this machine's choice
    (bf16 on a GPU or CPU that computes it fast, else fp32)."""
    import dataclasses

    from pretrain.distributed.env import detect_env

    cfg = load(RunConfig, path, overrides)
    if cfg.train.precision == "auto":
        mine = resolve_precision("auto")
        precision = run_precision(cfg) or mine
        if precision != mine and detect_env().is_main:
            print(f"train.precision=auto: {precision}, the precision {cfg.run_dir}'s checkpoints were trained in "
                  f"(this machine alone would pick {mine}); a resume cannot change it", file=sys.stderr, flush=True)
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))
    return cfg


def run_precision(cfg: RunConfig) -> str | None:
    """On a machine without a GPU, the ``train.precision`` (fp32 or bf16) recorded in the config.yaml of
    ``cfg.run_dir``'s newest complete checkpoint, when this launch resumes (checkpoint.resume=auto); None without one,
    when it cannot be read (the resume then verifies and names the damage), or on a GPU. A CPU run that says ``auto``
    keeps the precision it started in when a requeue lands on a node that would pick the other (a partition mixing
    CPUs with and without AMX-BF16): DeepSpeed's optimizer state cannot be loaded across precisions, so the resume
    would otherwise be refused, and a CPU runs either (bf16 slowly without AMX; the banner says so). A GPU without
    bf16 cannot run a bf16 run on: there the resume's refusal and its advice stay."""
    import torch

    if cfg.checkpoint.resume != "auto" or torch.cuda.is_available():
        return None
    from pretrain.checkpoint import store
    from pretrain.training.resume import saved_config

    ckpt_dir = store.checkpoints_dir(cfg.run_dir)
    tag = store.find_latest(ckpt_dir) if ckpt_dir.is_dir() else None
    saved = saved_config(ckpt_dir / tag) if tag is not None else None
    train = saved.get("train") if isinstance(saved, dict) else None
    precision = train.get("precision") if isinstance(train, dict) else None
    return precision if precision in ("fp32", "bf16") else None


__all__ = [
    "AugmentConfig", "CheckpointConfig", "DataConfig", "DistributedConfig", "EvalConfig", "MaskingConfig", "ModelConfig",
    "ObjectiveConfig", "OpsConfig", "OptimConfig", "RunConfig", "SourceConfig", "SpikeConfig", "TrainConfig",
    "apply_overrides", "from_dict", "load", "load_run_config", "read_yaml", "run_precision", "to_dict",
    "to_yaml",
]
