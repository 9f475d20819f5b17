"""The only module that imports DeepSpeed.

``Engine`` wraps ``deepspeed.initialize`` and owns the optimizer step: ``forward``, ``micro_step``
(backward + DeepSpeed's micro-step count), ``step`` (the update at the accumulation boundary, or its
skip when the gradients are non-finite) -> ``StepInfo``, ``save``, ``load``. The DeepSpeed JSON config is derived from the
typed configs (``ds_config.build_ds_config``) — users never write one by hand.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import types
from dataclasses import dataclass

import torch

from pretrain.config.train import (
    DistributedConfig,
    OptimConfig,
    TrainConfig,
    resolve_precision,
)
from pretrain.console import quiet_third_party, verbose
from pretrain.distributed.ds_config import build_ds_config, checks_on_device
from pretrain.distributed.env import cuda_device_index
from pretrain.distributed.snapshot import NotCopyable, copy_state


DS_NOISE = ("untested optimizer", "MPU is not provided")
"""DeepSpeed warnings about what the Engine does on purpose, through a stream DeepSpeed captured at import (past
``quiet_third_party``; shown with --verbose): ZeRO's "untested optimizer" (ScheduledAdamW, pinned by
tests/unit/test_deepspeed_contract.py), the universal loader's "MPU is not provided" (no tensor parallelism)."""


def _ds_noise(record: logging.LogRecord) -> bool:
    return verbose() or not any(noise in record.getMessage() for noise in DS_NOISE)


def _import_deepspeed():
    # DeepSpeed picks its accelerator at import time; on a machine without CUDA say "cpu" explicitly.
    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"
    import warnings

    import deepspeed

    # DeepSpeed's ZeRO calls torch collectives that torch marks deprecated, every step (ZeRO-3: two a rank and step).
    deprecated = ".*(all_gather_into_tensor|reduce_scatter_tensor).*"
    warnings.filterwarnings("ignore", message=deprecated, category=FutureWarning)
    for name in ("DeepSpeed", "deepspeed"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.WARNING)
        if _ds_noise not in logger.filters:
            logger.addFilter(_ds_noise)
    _import_muon_uncompiled()
    return deepspeed


@contextlib.contextmanager
def accelerator_syncs():
    """The calls of DeepSpeed's ``get_accelerator().synchronize()`` made inside (a list, an entry a call): on CUDA a
    ``cudaDeviceSynchronize``, which no op count sees and CUDA's sync debug mode does not flag (an explicit
    synchronize). DeepSpeed's throughput timer made two a step until ``ds_config`` turned it off."""
    _import_deepspeed()
    from deepspeed.accelerator import get_accelerator

    accelerator, calls = get_accelerator(), []
    synchronize = accelerator.synchronize
    accelerator.synchronize = lambda *args, **kwargs: calls.append(args) or synchronize(*args, **kwargs)
    try:
        yield calls
    finally:
        accelerator.synchronize = synchronize


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def _import_muon_uncompiled() -> None:
    """Import DeepSpeed's Muon optimizer module with its ``torch.compile`` wrappers made on first call.

    DeepSpeed 0.19 imports that module during every ZeRO-1/2 gradient reduction, in its bf16 optimizer and in
    ZeRO-3 (``isinstance(optimizer, MuonWithAuxAdam)``), and the module wraps three functions in
    ``torch.compile`` (``@compiler.compile()``) as it is imported: that imports torch._dynamo and torch._inductor,
    ~2-4 s of CPU in every rank, for an optimizer this trainer never builds. Here ``compiler.compile`` hands out a
    decorator that calls ``torch.compile`` on the function the first time it is called, so a Muon run compiles as
    before and every other run imports neither. What this relies on in DeepSpeed is pinned in
    tests/unit/test_deepspeed_contract.py."""
    import importlib
    import sys

    from deepspeed.runtime import compiler

    if MUON_MODULE in sys.modules:
        return
    original = compiler.compile

    def compile_on_first_call():
        def decorate(fn):
            compiled = None

            @functools.wraps(fn)
            def call(*args, **kwargs):
                nonlocal compiled
                if compiled is None:
                    compiled = original()(fn)
                return compiled(*args, **kwargs)

            call.compiles_on_first_call = True
            return call

        return decorate

    compiler.compile = compile_on_first_call
    try:
        importlib.import_module(MUON_MODULE)
    finally:
        compiler.compile = original


class ScheduledAdamW(torch.optim.AdamW):
    """Fused AdamW (CPU and CUDA) whose learning rate, gradient clip and veto are device tensors.

    The learning rate is ``base_lr * lr_lambda(updates applied so far)``, computed on the device from AdamW's own
    step count: a skipped update leaves the count, and so the schedule, where it was (as DeepSpeed's skip of its
    LR-scheduler step did), and the host never reads it. ``found_inf`` (torch's fused-step argument, set by
    ``Engine.step``) vetoes the update inside the kernel: parameters, moments and step count stay as they were.
    ``grad_scale`` (the other one, which torch's AdamW reads from the optimizer as it reads ``found_inf``) is the
    clip: the kernel divides each gradient by it as it reads it (and writes the quotient back), where a
    ``_foreach_mul_`` took one more pass over every gradient before the step. DeepSpeed calls ``step`` once per
    parameter group under ZeRO 1-2 (its flat fp32 partitions), once under ZeRO-0; the group's ``lr`` holds the
    tensor only during the call, so checkpoints keep a plain float (the base learning rate)."""

    def __init__(self, param_groups, *, lr: float, lr_lambda, **kwargs):
        super().__init__(param_groups, lr=lr, fused=True, **kwargs)
        self.base_lr, self.lr_lambda = lr, lr_lambda
        self.found_inf: torch.Tensor | None = None
        self.grad_scale: torch.Tensor | None = None
        self.step_lr: torch.Tensor | None = None
        """The Engine's ``current_lr`` of this update, set around DeepSpeed's step (which calls ``step`` once per
        parameter group under ZeRO 1-2): computed once an update, not once a call (~10 small ops each)."""

    def load_state_dict(self, state_dict) -> None:
        """A checkpoint's param groups carry its optimizer's options: one written by torch's per-parameter AdamW
        (pretrain before 2026-11-24) would turn ``fused`` off. Fused it stays, its step counts on the parameters'
        device in float32 as the fused kernel keeps them."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group.update(fused=True, foreach=None, capturable=False, differentiable=False)
            for p in group["params"]:
                state = self.state.get(p, {})
                if torch.is_tensor(state.get("step")):
                    state["step"] = state["step"].to(device=p.device, dtype=torch.float32)

    def applied_steps(self) -> torch.Tensor:
        """Updates applied so far (a device tensor: AdamW's step count, 0 before the first). ZeRO-3 leaves every
        group's ``params`` empty outside its per-group calls of ``step`` (as when ``Engine.step`` asks, before
        DeepSpeed's step): the count is then that of any parameter's state, equal for all between updates."""
        for group in self.param_groups:
            for p in group["params"]:
                step = self.state.get(p, {}).get("step")
                if step is not None:
                    return step
                return torch.zeros((), dtype=torch.float32, device=p.device)
        for state in self.state.values():
            if torch.is_tensor(state.get("step")):
                return state["step"]
        return torch.zeros(())

    def current_lr(self) -> torch.Tensor:
        """The learning rate of the next update (a float32 device tensor)."""
        return (self.base_lr * self.lr_lambda(self.applied_steps())).to(torch.float32)

    @torch.no_grad()
    def step(self, closure=None):
        lr_t = self.step_lr if self.step_lr is not None else self.current_lr()
        for group in self.param_groups:
            group["lr"] = lr_t
        try:
            return super().step(closure)
        finally:
            for group in self.param_groups:
                group["lr"] = self.base_lr


@dataclass
class StepInfo:
    """What one optimizer step did. Where the Engine checks on the device, ``grad_norm``, ``lr`` and ``skipped`` are
    device tensors (0-dim), read by the host only when it logs; elsewhere Python values."""
    grad_norm: float | torch.Tensor
    loss_scale: float
    lr: float | torch.Tensor
    skipped: bool | torch.Tensor


class Pieces:
    """A write-only file in memory: what ``torch.save`` writes, kept as the pieces it wrote (one copy each; a
    ``BytesIO`` copies again whenever it grows)."""

    def __init__(self):
        self.parts: list[bytes] = []

    def write(self, data) -> int:
        self.parts.append(bytes(data))
        return len(self.parts[-1])

    def flush(self) -> None:
        pass


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
        self.on_device = checks_on_device(self.precision, dist.zero_stage)
        self.clip_grad_norm = optim.clip_grad_norm
        optimizer = ScheduledAdamW(param_groups, lr=optim.lr, lr_lambda=lr_lambda, betas=tuple(optim.betas),
                                   eps=optim.eps, weight_decay=optim.weight_decay)
        self._adamw = optimizer
        num_params = sum(p.numel() for group in param_groups for p in group["params"])
        self.ds_config = build_ds_config(optim, train, dist, world_size, load_universal=load_universal,
                                         num_params=num_params)
        self.load_universal = load_universal
        self._anchor = dist.zero_stage == 3 and bool(getattr(module, "compiled_step", False))
        if self._anchor:
            # ZeRO-3 with the compiled step: DeepSpeed's gather and release hooks on every submodule are marked
            # torch.compiler.disable (a graph break per module). As a leaf, the whole module gathers its
            # parameters once before its forward, once before its backward (hooks around the compiled region,
            # not in it), and reduces their gradients in its full backward hook, which fires when the
            # gradients of its inputs are computed: the anchor that Engine.forward passes is that input, its
            # gradient produced by the same compiled backward node as the parameters'. Parameter memory in the
            # step is the whole model's (as ZeRO 1-2); gradients and optimizer states stay partitioned.
            from deepspeed.utils import set_z3_leaf_module

            set_z3_leaf_module(module, True)
        with quiet_third_party():  # "DeepSpeed ... shm_comm_op built successfully" and the like
            # No LR scheduler for DeepSpeed to step: the optimizer sets its own from its count of applied updates.
            # Its device: the one init_process_group pinned (DeepSpeed would take cuda:<LOCAL_RANK>).
            device_rank = cuda_device_index(env) if torch.cuda.is_available() else env.local_rank
            self.ds, self.optimizer, _, _ = deepspeed.initialize(
                model=module, optimizer=optimizer, config=self.ds_config, dist_init_required=False,
                args=types.SimpleNamespace(device_rank=device_rank),
            )
        self.device = self.ds.device

    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    def forward(self, *args, **kwargs):
        if self._anchor:  # see __init__
            args = (*args, torch.zeros((), device=self.device, requires_grad=True))
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

    def _grad_norm(self) -> torch.Tensor:
        """The L2 norm of this step's (rank-averaged) gradients, on the device, non-finite where any is: ZeRO-0
        holds them whole in ``p.grad``; ZeRO 1-2 hold a partition each (DeepSpeed's ``averaged_gradients``, its
        alignment padding left out), whose squares are summed over the ranks (one collective, no host sync). This
        is DeepSpeed's ``scaled_global_norm`` without its model- and pipeline-parallel cases, which the Engine
        never sets up, in one ``_foreach_norm`` instead of a norm per tensor and a collective per group
        (tests/distributed/test_zero_step.py compares the two)."""
        if self.zero_stage == 0:
            grads = [p.grad for p in self.ds.module.parameters() if p.grad is not None]
        else:
            opt = self.ds.optimizer
            parts = [opt.averaged_gradients.get(i) for i in range(len(opt.bit16_groups))]
            if any(p is None for p in parts):  # a host check: a norm of 0 would neither clip nor skip
                raise RuntimeError("DeepSpeed holds no gradient partition at the step (its ZeRO 1-2 optimizer's "
                                   "averaged_gradients): the Engine's norm relies on it; has DeepSpeed's gradient "
                                   "path changed? (tests/unit/test_deepspeed_contract.py)")
            grads = [g for part in parts for g in part if not getattr(g, "_zero_padding", False)]
        squares = (torch.stack(torch._foreach_norm(grads, dtype=torch.float32)).square().sum() if grads
                   else torch.zeros((), device=self.device))
        if self.zero_stage > 0 and torch.distributed.is_initialized():
            torch.distributed.all_reduce(squares, group=self.ds.optimizer.dp_process_group)
        return squares.sqrt()

    def step(self) -> StepInfo:
        """The optimizer step at an accumulation boundary (after the last ``micro_step``).

        Non-finite gradients skip the update everywhere. Where ``checks_on_device`` (fp32 at ZeRO 0-2, bf16 at ZeRO
        1-2) this is decided here without a host sync: one norm of all gradients (equal on every rank: ZeRO-0's
        are reduced whole, ZeRO 1-2's partial norms are summed over ranks), ``found_inf`` from it for the fused
        AdamW, the clip as its ``grad_scale``; the returned ``grad_norm``, ``lr`` and ``skipped`` are then device
        tensors, read when a log line needs them. Elsewhere DeepSpeed checks, clips and reports (host values)."""
        if not self.ds.is_gradient_accumulation_boundary():
            raise RuntimeError("Engine.step() between accumulation boundaries: call micro_step() once per "
                               "micro-batch (train.grad_accum of them) before step()")
        lr = self._adamw.current_lr()
        self._adamw.step_lr = lr
        try:
            return self._step(lr)
        finally:
            self._adamw.step_lr = None

    def _step(self, lr: torch.Tensor) -> StepInfo:
        if not self.on_device:
            self.ds.step()
            norm = self.ds.get_global_grad_norm()
            scale = self._loss_scale() if self.precision == "fp16" else 1.0
            return StepInfo(grad_norm=norm if norm is not None else float("nan"), loss_scale=scale, lr=lr,
                            skipped=not self.ds.was_step_applied())  # non-finite gradients, fp16 overflow
        norm = self._grad_norm()
        bad = ~torch.isfinite(norm) | (norm < 0)
        self._adamw.found_inf = bad.float()
        if self.clip_grad_norm > 0:
            # DeepSpeed's clip: gradients / max(1, (norm + 1e-6) / max_norm), divided inside the fused AdamW.
            self._adamw.grad_scale = torch.clamp((norm + 1e-6) / self.clip_grad_norm, min=1.0)
        self.ds.step()
        return StepInfo(grad_norm=norm, loss_scale=1.0, lr=lr, skipped=bad)

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

    def snapshot(self, directory: str, tag: str, client_state: dict, *, pool=None) -> list[tuple[str, object]]:
        """Collective: DeepSpeed's save of ``directory/tag`` held in host memory instead of files — the (path, what
        it holds) of every file this rank would write: its bytes in pieces, byte for byte what ``torch.save`` would
        put there, or, given a ``snapshot.StoragePool``, a ``CopiedState`` (the state copied into the
        pool's buffers; its ``save`` writes those same bytes later). Only directories (and rank 0's copy of
        DeepSpeed's small zero_to_fp32.py) reach the disk; writing is the caller's, off the training path
        (checkpoint/writer.py)."""
        deepspeed = _import_deepspeed()
        from deepspeed.runtime.checkpoint_engine.checkpoint_engine import (
            CheckpointEngine,
        )

        real = self.ds.checkpoint_engine
        zipfile = getattr(real, "zipfile_serialization", True)
        captured: list[tuple[str, list[bytes]]] = []

        class _Capture(CheckpointEngine):
            def create(self, info):
                pass

            def save(self, state_dict, path: str):
                if pool is not None:
                    try:
                        captured.append((str(path), copy_state(state_dict, pool, zipfile=zipfile)))
                        return
                    except NotCopyable:
                        pass  # serialized now, as without a pool
                pieces = Pieces()
                torch.save(state_dict, pieces, _use_new_zipfile_serialization=zipfile)
                captured.append((str(path), pieces.parts))

            def load(self, path: str, map_location=None):
                raise RuntimeError("the snapshot engine only saves")

            def commit(self, info):
                return True

        self.ds.checkpoint_engine = _Capture()
        try:
            self.ds.save_checkpoint(directory, tag=tag, client_state=client_state, save_latest=False)
        finally:
            self.ds.checkpoint_engine = real
        del deepspeed
        return captured

    def load(self, directory: str, tag: str, *, load_optimizer: bool = True) -> dict:
        """Collective: model, optimizer and LR schedule from ``directory/tag`` (a universal checkpoint when the
        engine was built with ``load_universal``)."""
        # ZeRO-3's universal loader (DeepSpeed 0.19, stage3.py load_hp_checkpoint_state_from_checkpoint_dir_stage3)
        # gives every param group the first group's hyperparameters (the no-decay group would get the weights'
        # weight_decay) and one shared Adam step-count tensor, which each group's step then increments again
        # (the second group's bias correction would run a step ahead). Both are undone after the load.
        groups_before = [{k: v for k, v in g.items() if k not in ("params", "lr", "initial_lr")}
                         for g in self._adamw.param_groups]
        zero_opt = self.ds.optimizer if self.on_device and self.zero_stage in (1, 2) else None
        if zero_opt is not None:
            # A checkpoint written while DeepSpeed clipped (before the Engine did, or by a run without on-device
            # checks) records its clip value, which DeepSpeed refuses under compute_grad_norm=False and would
            # otherwise adopt: read it as DeepSpeed wants, then hand norm and clip back to the Engine.
            zero_opt.compute_grad_norm = True
        try:
            path, client_state = self.ds.load_checkpoint(
                directory, tag=tag, load_optimizer_states=load_optimizer, load_lr_scheduler_states=False,
                load_module_strict=True,
            )
        finally:
            if zero_opt is not None:
                zero_opt.compute_grad_norm, zero_opt.clip_grad = False, 0.0
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


def fp32_state_dict_from_checkpoint(tag_dir: str, *, in_thread: bool = False) -> dict:
    """Full fp32 module state dict from a DeepSpeed checkpoint tag directory, any ZeRO stage, on CPU.

    ZeRO 1–3 keep the fp32 master weights in optimizer partitions; they are merged with
    DeepSpeed's own reader. Stage 0 keeps them in the module states file. ``in_thread``: called beside a
    running trainer (the background checkpoint writer), where redirecting the process's stdout would swallow the
    trainer's lines too: the reader's prints and progress bar are muted in its own module instead.
    """
    deepspeed = _import_deepspeed()
    from deepspeed.utils import zero_to_fp32

    tag_dir = os.path.abspath(tag_dir)
    parent, tag = os.path.dirname(tag_dir), os.path.basename(tag_dir)
    has_zero = any(f.endswith("optim_states.pt") and "zero_pp_rank" in f for f in os.listdir(tag_dir))
    if has_zero:
        if in_thread:
            with _muted(zero_to_fp32):
                sd = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(parent, tag=tag)
        else:
            with quiet_third_party():  # five lines and a "Loading checkpoint shards" bar per checkpoint
                sd = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(parent, tag=tag)
        return {k: v.float() for k, v in sd.items()}
    model_files = sorted(f for f in os.listdir(tag_dir) if f.endswith("model_states.pt"))
    if not model_files:
        raise FileNotFoundError(f"{tag_dir} holds no DeepSpeed model states; is it a checkpoint directory?")
    state = torch.load(os.path.join(tag_dir, model_files[0]), map_location="cpu", weights_only=False)
    del deepspeed
    return {k: v.float() if v.is_floating_point() else v for k, v in state["module"].items()}


@contextlib.contextmanager
def _muted(module):
    """``module``'s own ``print`` and ``tqdm`` silenced (module globals: other threads' output is untouched)."""
    saved = {name: module.__dict__.get(name) for name in ("print", "tqdm")}
    module.print = lambda *args, **kwargs: None
    module.tqdm = lambda iterable, *args, **kwargs: iterable
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                module.__dict__.pop(name, None)
            else:
                setattr(module, name, value)
