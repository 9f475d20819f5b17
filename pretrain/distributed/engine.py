"""The only module that imports DeepSpeed.

``Engine`` wraps ``deepspeed.initialize`` and owns the optimizer step: ``forward``, ``micro_step``
(backward + DeepSpeed's micro-step count), ``step`` (the update at the accumulation boundary, or its
skip when the gradients are non-finite) -> ``StepInfo``, ``save``, ``load``. The DeepSpeed JSON config is derived from the
typed configs (``build_ds_config``) — users never write one by hand.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

import torch

from pretrain.config.train import (
    DistributedConfig,
    OptimConfig,
    TrainConfig,
    resolve_precision,
)
from pretrain.console import quiet_third_party


def _import_deepspeed():
    # DeepSpeed picks its accelerator at import time; on a machine without CUDA say "cpu" explicitly.
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    import warnings

    import deepspeed

    # DeepSpeed's ZeRO calls a torch collective that torch marks deprecated, once per step.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    for name in ("DeepSpeed", "deepspeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return deepspeed


def build_ds_config(optim: OptimConfig, train: TrainConfig, dist: DistributedConfig, world_size: int, *,
                    load_universal: bool = False) -> dict:
    """Typed configs -> DeepSpeed config dict. ``load_universal``: ``load`` reads a universal checkpoint
    (``convert_to_universal``), which re-splits ZeRO's optimizer partitions over this world size."""
    zero: dict = {"stage": dist.zero_stage}
    if dist.zero_stage >= 2:
        zero.update(overlap_comm=False, contiguous_gradients=True, reduce_scatter=True)
    if dist.zero_stage == 3:
        zero.update(stage3_gather_16bit_weights_on_model_save=False)
    cfg = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum,
        "train_batch_size": train.micro_batch_size * train.grad_accum * world_size,
        "gradient_clipping": optim.clip_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**12,
        "wall_clock_breakdown": False,
        "checkpoint": {"load_universal": load_universal},
    }
    precision = resolve_precision(train.precision)  # a TrainConfig built in code may still say "auto"
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif precision == "fp16":
        # Dynamic loss scaling: loss_scale 0 means "dynamic" in DeepSpeed.
        cfg["fp16"] = {"enabled": True, "loss_scale": 0, "initial_scale_power": 16, "loss_scale_window": 1000,
                       "hysteresis": 2, "min_loss_scale": 1}
    return cfg


class GuardedAdamW(torch.optim.AdamW):
    """AdamW whose update the Engine can veto (non-finite gradients where DeepSpeed does not check them).

    A vetoed ``step()`` changes nothing: parameters, ``exp_avg``/``exp_avg_sq`` and the step count stay as
    they were, and DeepSpeed, which reads ``overflow`` after ``step()``, skips its LR-scheduler step as for
    an fp16 overflow. (DeepSpeed's ZeRO 1-3, bf16 and fp16 optimizers check the gradients themselves and
    then never call this step; only ZeRO-0 in fp32 hands them straight to AdamW.)
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.veto = False
        self.overflow = False

    @torch.no_grad()
    def step(self, closure=None):
        self.overflow, self.veto = self.veto, False
        if self.overflow:
            return None
        return super().step(closure)


@dataclass
class StepInfo:
    grad_norm: float
    loss_scale: float
    lr: float
    skipped: bool


class Engine:
    """A DeepSpeed engine around ``module`` with a client AdamW and LambdaLR schedule."""

    def __init__(self, module: torch.nn.Module, param_groups: list[dict], *, optim: OptimConfig,
                 train: TrainConfig, dist: DistributedConfig, env, lr_lambda, load_universal: bool = False):
        deepspeed = _import_deepspeed()
        world_size = env.world_size
        # DeepSpeed reads the launcher's variables even when the process group already exists.
        for key, value in (("LOCAL_RANK", env.local_rank), ("RANK", env.rank), ("WORLD_SIZE", world_size)):
            os.environ.setdefault(key, str(value))
        self.precision = resolve_precision(train.precision)
        self.zero_stage = dist.zero_stage
        self.grad_accum = train.grad_accum
        use_fused = torch.cuda.is_available()
        # ZeRO 1-3 check the gradients themselves (and DeepSpeed accepts only AdamW itself there without
        # an "untested optimizer" warning); ZeRO-0 gets the vetoable subclass.
        adamw = GuardedAdamW if dist.zero_stage == 0 else torch.optim.AdamW
        optimizer = adamw(param_groups, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps,
                          weight_decay=optim.weight_decay, **({"fused": True} if use_fused else {}))
        self._adamw = optimizer
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)
        self.ds_config = build_ds_config(optim, train, dist, world_size, load_universal=load_universal)
        self.load_universal = load_universal
        with quiet_third_party():  # "DeepSpeed ... shm_comm_op built successfully" and the like
            self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=module, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config,
                dist_init_required=False,
            )
        self.device = self.ds.device

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    def forward(self, *args, **kwargs):
        return self.ds(*args, **kwargs)

    def micro_step(self, loss: torch.Tensor, *, finite: torch.Tensor | None = None) -> None:
        """Backward of one micro-batch; between accumulation boundaries DeepSpeed's micro-step is counted too.

        ``finite``: a 0-dim bool tensor (decided on the device, no host sync); where it is False, NaN goes into
        the gradients instead, so that whichever optimizer DeepSpeed runs refuses the whole update at the
        boundary (``step()`` then reports ``skipped``) on every rank, since the NaN reaches every rank through
        the gradients' reduction: parameters, optimizer moments, step count and the LR schedule stay as they
        were. Under fp16 this also halves the dynamic loss scale."""
        if finite is not None:
            # loss x 1 is the loss bit for bit; loss x NaN makes every gradient it reaches NaN.
            loss = loss * torch.where(finite, 1.0, float("nan")).to(loss.dtype)
        self.ds.backward(loss)
        if not self.ds.is_gradient_accumulation_boundary():
            self.ds.step()  # DeepSpeed counts micro-steps in step(); it updates only at the boundary

    def whole_grad_norm(self) -> float | None:
        """L2 norm of the gradients when they are held whole in ``p.grad`` (no ZeRO, after backward at a
        boundary, already averaged over ranks); None when ZeRO partitions them."""
        if self.zero_stage != 0:
            return None
        norms = [torch.linalg.vector_norm(p.grad.detach().float()) for p in self.ds.module.parameters()
                 if p.grad is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0

    def step(self) -> StepInfo:
        """The optimizer step at an accumulation boundary (after the last ``micro_step``).

        Non-finite gradients skip the update everywhere: DeepSpeed's own check under ZeRO 1-3, bf16 and
        fp16, and here (a veto on AdamW) under ZeRO-0 fp32, whose reduced gradients are whole and equal on
        every rank, so every rank decides alike without a collective."""
        if not self.ds.is_gradient_accumulation_boundary():
            raise RuntimeError("Engine.step() between accumulation boundaries: call micro_step() once per "
                               "micro-batch (train.grad_accum of them) before step()")
        lr = self.scheduler.get_last_lr()[0]
        grad_norm = self.whole_grad_norm()
        guarded = isinstance(self._adamw, GuardedAdamW)
        if guarded:
            self._adamw.veto = grad_norm is not None and not math.isfinite(grad_norm)
        self.ds.step()
        if guarded:
            self._adamw.veto = False  # DeepSpeed's own check may have skipped AdamW.step (bf16/fp16)
        norm = self.ds.get_global_grad_norm()
        norm = float(norm) if norm is not None else (grad_norm if grad_norm is not None else float("nan"))
        scale = self._loss_scale() if self.precision == "fp16" else 1.0
        skipped = not self.ds.was_step_applied()  # non-finite gradients (any check above), fp16 overflow
        return StepInfo(grad_norm=norm, loss_scale=scale, lr=lr, skipped=skipped)

    def _loss_scale(self) -> float:
        """fp16's current dynamic loss scale: ZeRO's optimizers expose ``cur_scale``, DeepSpeed's ZeRO-0 fp16
        optimizers keep it in ``loss_scale_config.cur_scale``."""
        opt = self.ds.optimizer
        scale = getattr(opt, "cur_scale", None)
        if scale is None:
            scale = getattr(getattr(opt, "loss_scale_config", None), "cur_scale", None)
        return float(scale) if scale else 1.0

    def train(self) -> None:
        self.ds.train()

    def eval(self) -> None:
        self.ds.eval()

    def save(self, directory: str, tag: str, client_state: dict) -> None:
        """Collective: every rank writes its partition under ``directory/tag``."""
        self.ds.save_checkpoint(directory, tag=tag, client_state=client_state, save_latest=False)

    def load(self, directory: str, tag: str, *, load_optimizer: bool = True) -> dict:
        """Collective: model, optimizer and LR schedule from ``directory/tag`` (a universal checkpoint when the
        engine was built with ``load_universal``)."""
        # ZeRO-3's universal loader (DeepSpeed 0.19, stage3.py load_hp_checkpoint_state_from_checkpoint_dir_stage3)
        # gives every param group the first group's hyperparameters (the no-decay group would get the weights'
        # weight_decay) and one shared Adam step-count tensor, which each group's step then increments again
        # (the second group's bias correction would run a step ahead). Both are undone after the load.
        groups_before = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
                         for g in self._adamw.param_groups]
        path, client_state = self.ds.load_checkpoint(
            directory, tag=tag, load_optimizer_states=load_optimizer, load_lr_scheduler_states=load_optimizer,
            load_module_strict=True,
        )
        if path is None:
            raise FileNotFoundError(f"DeepSpeed could not load checkpoint {directory}/{tag}")
        if self.load_universal:
            if self.zero_stage == 3:
                for group, before in zip(self._adamw.param_groups, groups_before):
                    group.update(before)
            for state in self._adamw.state.values():
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].clone()
        return client_state or {}


def convert_to_universal(tag_dir: str, out_dir: str, *, log) -> None:
    """DeepSpeed's ``ds_to_universal`` of a ZeRO 1-3 checkpoint tag directory into ``out_dir`` (which must not
    exist): every parameter's fp32 weights and Adam moments as whole tensors, loadable on any number of ranks
    by an engine built with ``load_universal``. Reads (unpickles) the tag's own DeepSpeed files; its progress
    output goes to the text file ``log``. Also writes ``latest_universal`` next to ``out_dir``."""
    import argparse
    import contextlib

    _import_deepspeed()
    from deepspeed.checkpoint import ds_to_universal

    # One process, no worker pool (the caller may be a rank of a running job); our modules carry no
    # universal-checkpoint info, which DeepSpeed then injects (a plain data-parallel model needs none).
    args = argparse.Namespace(input_folder=str(tag_dir), output_folder=str(out_dir), num_extract_workers=1,
                              num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        ds_to_universal.main(args)


def fp32_state_dict_from_checkpoint(tag_dir: str) -> dict:
    """Full fp32 module state dict from a DeepSpeed checkpoint tag directory, any ZeRO stage, on CPU.

    ZeRO 1–3 keep the fp32 master weights in optimizer partitions; they are merged with
    DeepSpeed's own reader. Stage 0 keeps them in the module states file.
    """
    deepspeed = _import_deepspeed()
    from deepspeed.utils import zero_to_fp32

    tag_dir = os.path.abspath(tag_dir)
    parent, tag = os.path.dirname(tag_dir), os.path.basename(tag_dir)
    has_zero = any(f.endswith("optim_states.pt") and "zero_pp_rank" in f for f in os.listdir(tag_dir))
    if has_zero:
        with quiet_third_party():  # five lines and a "Loading checkpoint shards" bar per checkpoint
            sd = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(parent, tag=tag)
        return {k: v.float() for k, v in sd.items()}
    model_files = sorted(f for f in os.listdir(tag_dir) if f.endswith("model_states.pt"))
    if not model_files:
        raise FileNotFoundError(f"{tag_dir} holds no DeepSpeed model states; is it a checkpoint directory?")
    state = torch.load(os.path.join(tag_dir, model_files[0]), map_location="cpu", weights_only=False)
    del deepspeed
    return {k: v.float() if v.is_floating_point() else v for k, v in state["module"].items()}
