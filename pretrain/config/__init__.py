"""Typed configs: dataclass trees loaded from YAML with dotted overrides."""

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


def load_run_config(path=None, overrides=None, run_precision=None) -> RunConfig:
    """configs/*.yaml + ['optim.lr=3e-4', ...] -> RunConfig (strict), with ``train.precision=auto`` resolved:
    ``run_precision(cfg, mine)`` when it gives one (the trainer's CLI passes ``training.resume.run_precision``: a CPU
    run resuming keeps the precision its checkpoints were trained in), else this machine's choice ``mine`` (bf16 on a
    GPU or CPU that computes it fast, else fp32)."""
    import dataclasses

    cfg = load(RunConfig, path, overrides)
    if cfg.train.precision == "auto":
        mine = resolve_precision("auto")
        precision = (run_precision(cfg, mine) if run_precision is not None else None) or mine
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=precision))
    return cfg


__all__ = [
    "AugmentConfig", "CheckpointConfig", "DataConfig", "DistributedConfig", "EvalConfig", "MaskingConfig", "ModelConfig",
    "ObjectiveConfig", "OpsConfig", "OptimConfig", "RunConfig", "SourceConfig", "SpikeConfig", "TrainConfig",
    "apply_overrides", "from_dict", "load", "load_run_config", "read_yaml", "to_dict", "to_yaml",
]
