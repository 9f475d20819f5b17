"""The root of the config tree."""

from __future__ import annotations

from dataclasses import dataclass, field

from pretrain.config.data import DataConfig
from pretrain.config.model import ModelConfig
from pretrain.config.objective import ObjectiveConfig
from pretrain.config.train import (
    CheckpointConfig,
    DistributedConfig,
    EvalConfig,
    OpsConfig,
    OptimConfig,
    TrainConfig,
)


@dataclass(kw_only=True)
class RunConfig:
    run_dir: str = "runs/default"
    """Output directory: config.yaml, metrics.jsonl, tb/, checkpoints/."""
    seed: int = 1234
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    ops: OpsConfig = field(default_factory=OpsConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    given: frozenset[str] = field(default=frozenset(), repr=False, compare=False, metadata={"internal": True})
    """Not a config key: the dotted keys the YAML files and overrides set (filled by ``config.load``), so that
    ``checkpoint.init_from`` can tell the model.* settings chosen from the defaults it may fill in."""

    def __post_init__(self) -> None:
        self.train.unpadded_layout(self.model.arch)  # refuses train.unpadded_attention=varlen off BERT
        embedding = [name for name in self.objective.enabled() if name != "mlm"]
        if self.model.pooling == "first_last_avg" and embedding:
            # The training step pools the last layer's states only (its passes may be unpadded, trimmed to the
            # pooled tokens, or compiled); SimCSE's first_last_avg is an evaluation pooling.
            raise ValueError(
                f"model.pooling=first_last_avg (the mean of the first and the last layer's states, SimCSE's "
                f"evaluation pooling) cannot embed sentences in training, which objective."
                f"{', objective.'.join(embedding)} do{'es' if len(embedding) == 1 else ''}: set model.pooling to "
                f"cls, cls_before_pooler or mean, and evaluate with eval.pooling=first_last_avg (or pretrain-eval "
                f"--pooling first_last_avg)")

    @property
    def step_compiled(self) -> bool:
        """Whether train.compile compiles the step: not under objective.gradient_cache, whose passes run eagerly
        (config/lint.py says so)."""
        return self.train.compile and not self.objective.gradient_cache

    @property
    def step_bucketed(self) -> bool:
        """Whether the compiled step's batches are bucketed (train.compile_shapes=bucketed: training/step.py's
        Buckets)."""
        return self.step_compiled and self.train.compile_shapes == "bucketed"
