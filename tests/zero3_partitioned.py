"""ZeRO-3 with no parameter kept whole between its uses, for tests of its gathers at tiny sizes.

DeepSpeed's defaults keep a parameter of under 1e5 elements whole (persistent) and up to 1e9 elements live
between uses, which at a test's sizes is every parameter: its gathers and releases would never run."""

from __future__ import annotations

PARTITIONED = {"stage3_param_persistence_threshold": 0, "stage3_max_live_parameters": 0,
               "stage3_max_reuse_distance": 0, "stage3_prefetch_bucket_size": 0}


def partitioned(build_ds_config):
    """``ds_config.build_ds_config`` (as distributed/engine.py calls it) with ZeRO-3's configs made to partition
    every parameter between uses."""

    def build(*args, **kwargs):
        cfg = build_ds_config(*args, **kwargs)
        if cfg["zero_optimization"]["stage"] == 3:
            cfg["zero_optimization"].update(PARTITIONED)
        return cfg

    return build
