"""The DeepSpeed config, derived from the typed configs (``build_ds_config``; distributed/engine.py hands it to
``deepspeed.initialize``), and which checks the Engine takes over from DeepSpeed (``checks_on_device``)."""

from __future__ import annotations

from pretrain.config.train import (
    DistributedConfig,
    OptimConfig,
    TrainConfig,
    resolve_precision,
)

DS_REDUCE_BUCKET = 500_000_000
"""DeepSpeed's default ``zero_optimization.reduce_bucket_size``, in elements."""


def reduce_bucket_size(num_params: int) -> int:
    """ZeRO 1-2's gradient bucket: DeepSpeed's default, or the trained parameters' count where that is smaller.
    Under ZeRO-2 (contiguous gradients) DeepSpeed allocates the bucket (a ``torch.empty`` of this many elements in
    the gradients' reduction dtype) at every micro-step and frees it after the reduction. At its default that is
    2 GB in fp32 whatever the model: on the CPU, past glibc's mmap threshold (even the trainer's 1 GiB), a fresh
    mapping whose touched pages fault in again at every step (ModernBERT mini: 10,000 faults, ~30 ms a step); on a
    GPU, 1-2 GB held by the caching allocator beside a model that needs a tenth of it. A bucket the size of the
    model holds every gradient, as the default does for any model under 500M parameters: one reduction per
    micro-step either way, the same sums."""
    return max(1, min(DS_REDUCE_BUCKET, num_params))


def build_ds_config(optim: OptimConfig, train: TrainConfig, dist: DistributedConfig, world_size: int, *,
                    load_universal: bool = False, num_params: int = 0) -> dict:
    """Typed configs -> DeepSpeed config dict. ``load_universal``: ``load`` reads a universal checkpoint
    (``convert_to_universal``), which re-splits ZeRO's optimizer partitions over this world size.
    ``num_params``: the trained parameters' count, which sizes ZeRO 1-2's gradient bucket (``reduce_bucket_size``;
    0: DeepSpeed's default)."""
    precision = resolve_precision(train.precision)  # a TrainConfig built in code may still say "auto"
    on_device = checks_on_device(precision, dist.zero_stage)
    zero: dict = {"stage": dist.zero_stage}
    if on_device and dist.zero_stage > 0:
        zero.update(compute_grad_norm=False)  # the Engine computes the norm (on the device) and clips
    if dist.zero_stage in (1, 2) and num_params > 0:
        zero.update(reduce_bucket_size=reduce_bucket_size(num_params))
    if dist.zero_stage >= 2:
        zero.update(overlap_comm=False, contiguous_gradients=True, reduce_scatter=True)
    if dist.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=False)
    cfg = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum,
        "train_batch_size": train.micro_batch_size * train.grad_accum * world_size,
        "gradient_clipping": 0.0 if on_device else optim.clip_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer (on by default, "synchronized") calls get_accelerator().synchronize(), on CUDA
        # a cudaDeviceSynchronize, when each forward starts and each optimizer step ends: the host waited for the
        # device twice a step (the H200 profile's unattributed waits, 2026-11-28); the trainer times its own steps.
        "timers": {"throughput": {"enabled": False}},
        "checkpoint": {"load_universal": load_universal},
    }
    if precision == "bf16":
        # Where the Engine decides the skip itself, DeepSpeed's per-parameter overflow check would only repeat it.
        cfg["bf16"] = {"enabled": True, "check_grad_overflow": not on_device}
    elif precision == "fp16":
        # Dynamic loss scaling: loss_scale 0 means "dynamic" in DeepSpeed.
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
    return cfg


def checks_on_device(precision: str, zero_stage: int) -> bool:
    """Whether the Engine itself (on the device, no host sync) decides a step's skip and clips the gradients, with
    DeepSpeed's own overflow check, norm and clipping off: fp32 at ZeRO 0-2 and bf16 at ZeRO 1-2. Elsewhere
    DeepSpeed keeps them: fp16 (its dynamic loss scale needs its overflow check), bf16 at ZeRO-0 (DeepSpeed's
    bf16 wrapper there checks every parameter and cannot be told not to) and ZeRO-3 (its partitioned norm)."""
    if precision == "fp16" or zero_stage == 3:
        return False
    return zero_stage in (1, 2) or precision == "fp32"
