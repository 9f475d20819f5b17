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


def load_run_config(path=None, overrides=None) -> RunConfig:
    """configs/*.yaml + ['optim.lr=3e-4', ...] -> RunConfig (strict), with ``train.precision=auto`` resolved for
    this machine's device (bf16 on a GPU that computes it fast, else fp32)."""
    import dataclasses


    cfg = load(RunConfig, path, overrides)
    if cfg.train.precision == "auto":
        cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, precision=resolve_precision("auto")))
    return cfg


__all__ = [
    "AugmentConfig", "CheckpointConfig", "DataConfig", "DistributedConfig", "EvalConfig", "MaskingConfig", "ModelConfig",
    "ObjectiveConfig", "OpsConfig", "OptimConfig", "RunConfig", "SourceConfig", "SpikeConfig", "TrainConfig",
    "apply_overrides", "from_dict", "load", "load_run_config", "read_yaml", "to_dict", "to_yaml",
]
