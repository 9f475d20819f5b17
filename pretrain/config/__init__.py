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
    TrainConfig,
)


def load_run_config(path=None, overrides=None) -> RunConfig:
    """configs/*.yaml + ['optim.lr=3e-4', ...] -> RunConfig (strict)."""
    return load(RunConfig, path, overrides)


__all__ = [
    "AugmentConfig", "CheckpointConfig", "DataConfig", "DistributedConfig", "EvalConfig", "MaskingConfig", "ModelConfig",
    "ObjectiveConfig", "OpsConfig", "OptimConfig", "RunConfig", "SourceConfig", "TrainConfig",
    "apply_overrides", "from_dict", "load", "load_run_config", "read_yaml", "to_dict", "to_yaml",
]
