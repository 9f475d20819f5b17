"""The trainer's step forces no host-device sync (pretrain/metrics/op_count.py counts the ops that would on CUDA): a
step that does not log runs forward, loss, backward, metrics and the optimizer step (``Engine.step``: the norm, the
finite check, the clip and the fused AdamW update, all on the device) without the host waiting for the device.
``Engine.step`` is counted apart so that a failure says whose sync it is. Where DeepSpeed keeps its own checks
(fp16, bf16 at ZeRO-0, ZeRO-3: ``ds_config.checks_on_device``) its syncs are reported by tools/bench_step.py. The step
runs unpadded (train.unpadded, the default: the host packs the sequences) and, once, padded."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import _disable_current_modes

from pretrain.config import load_run_config
from pretrain.distributed.env import (
    destroy_process_group,
    init_process_group,
    single_process_env,
)
from pretrain.distributed.engine import accelerator_syncs
from pretrain.metrics.op_count import OpCounter
from pretrain.training.step import PREPARED
from pretrain.training.trainer import Trainer


def _count_steps(trainer, steps: int) -> tuple[OpCounter, OpCounter]:
    """(ops of the trainer's steps outside Engine.step, ops of Engine.step) over ``steps`` (2 or more) steps after a
    warm-up; and that DeepSpeed synchronized the device in none of them (``engine.accelerator_syncs``: its
    throughput timer did at every forward and every step from its third step on, until ds_config turned it off)."""
    loader = iter(trainer._loader(trainer.train_set, 0))
    trainer.engine.train()
    trainer.train_step(loader)  # warm-up: first-call work (allocations, DeepSpeed's lazy set-up) is not a step
    ds_step, inner = trainer.engine.step, OpCounter()

    def step_counted_apart():
        with _disable_current_modes(), inner:
            return ds_step()

    trainer.engine.step = step_counted_apart
    try:
        with accelerator_syncs() as waits, OpCounter() as outer:
            for _ in range(steps):
                trainer.train_step(loader)
    finally:
        trainer.engine.step = ds_step
    assert not waits, f"DeepSpeed synchronized the device {len(waits)} times in {steps} steps"
    return outer, inner


MODERN = {"model__arch": "modernbert", "model__pooler": "false", "model__num_layers": 3, "model__local_window": 16}
"""model.arch=modernbert with its window under data.max_len (rotary tables and window masks built in the step)."""


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage, precision, grad_accum, unpadded, cached, modern, joint",
                         [(0, "fp32", 1, True, False, False, True), (0, "fp32", 2, True, False, False, False),
                          (2, "fp32", 1, True, False, False, True), (2, "bf16", 2, True, False, False, True),
                          (1, "bf16", 1, True, False, False, False), (0, "fp32", 1, False, False, False, True),
                          (0, "fp32", 2, True, True, False, True), (2, "fp32", 2, True, True, False, True),
                          (0, "fp32", 1, True, False, True, True), (0, "fp32", 1, False, False, True, True)])
def test_a_step_that_does_not_log_forces_no_sync(zero_stage, precision, grad_accum, unpadded, cached, modern, joint,
                                                  tmp_path, tiny_overrides, clean_env, capsys):
    """``cached``: objective.gradient_cache (training/cached_step.py) on the same steps; ``modern``:
    model.arch=modernbert; ``joint``: train.joint_pass (the default; false: the MLM rows and views in two passes)."""
    cfg = load_run_config(None, tiny_overrides(tmp_path / "run", data__valid="[]", distributed__zero_stage=zero_stage,
                                               train__grad_accum=grad_accum, train__precision=precision,
                                               train__unpadded=unpadded, objective__gradient_cache=cached,
                                               train__joint_pass=joint,
                                               **(MODERN if modern else {})))
    env = single_process_env()
    init_process_group(env, backend="gloo", timeout_s=60)
    trainer = None
    try:
        trainer = Trainer(cfg, env)
        forward, packed, joined = trainer.engine.forward, [], []

        def forward_seen(batch, **kwargs):  # which path the trainer's step took
            packed.append("packed_mlm" in batch and "packed_views" in batch)
            joined.append("packed_joint" in batch and trainer.module.objective.ctx.joint_pass)
            return forward(batch, **kwargs)

        trainer.engine.forward = forward_seen
        outer, inner = _count_steps(trainer, steps=2)
        with capsys.disabled():
            print(f"\nZeRO-{zero_stage} {precision} grad_accum {grad_accum} unpadded {unpadded}"
                  f"{' cached' if cached else ''}{' modernbert' if modern else ''}{' joint' if joint else ''}, "
                  f"per step: trainer {outer.num_aten / 2:.0f} aten ops, "
                  f"{outer.num_sync / 2:g} syncs {dict(outer.syncs)}; Engine.step {inner.num_aten / 2:.0f} ops, "
                  f"{inner.num_sync / 2:g} syncs {dict(inner.syncs)}")
        assert outer.num_aten > 100  # the counter saw the step
        assert outer.num_sync == 0, dict(outer.where)
        assert inner.num_aten > 10 and inner.num_sync == 0, dict(inner.where)
        assert set(packed) == {unpadded}
        assert set(joined) == {unpadded and joint and not cached}  # train.joint_pass: one encoder pass
        # The metrics the step accumulated are still there, fetched in one go at the log step.
        scalars = trainer.window.sums.reduce(env)
        assert torch.isfinite(torch.tensor(scalars["loss"])) and "mlm" in scalars
    finally:
        if trainer is not None:
            trainer.close()
        destroy_process_group()


@pytest.mark.slow
def test_a_compiled_step_that_does_not_log_forces_no_sync(tmp_path, tiny_overrides, clean_env):
    """train.compile (aot_eager: the traced graph's own aten ops) at ZeRO-2, unpadded (the fixed attention layout,
    train.compile's default since 2026-11-28; the padded compiled step ran here before): the compiled forward and
    loss add none (what CUDA graphs need: no host sync inside the captured region)."""
    cfg = load_run_config(None, tiny_overrides(tmp_path / "run", data__valid="[]", distributed__zero_stage=2,
                                               train__compile="true", train__compile_backend="aot_eager"))
    env = single_process_env()
    init_process_group(env, backend="gloo", timeout_s=60)
    trainer = None
    try:
        torch._dynamo.reset()
        trainer = Trainer(cfg, env)
        outer, inner = _count_steps(trainer, steps=2)
        assert outer.num_aten > 100
        assert outer.num_sync == 0, dict(outer.where)
        assert inner.num_sync == 0, dict(inner.where)
    finally:
        if trainer is not None:
            trainer.close()
        destroy_process_group()


@pytest.mark.slow
def test_the_trainer_takes_the_attention_layout_it_is_given(tmp_path, tiny_overrides, clean_env):
    """train.unpadded_attention: auto is the groups on the CPU; varlen reaches the step as streams with cumulative
    lengths and no groups, and the step trains (on the CPU torch's nested-jagged math path reads each length on the
    host, so no sync count here: tests/gpu checks the CUDA path waits for nothing)."""
    env = single_process_env()
    for choice, want in (("auto", "groups"), ("varlen", "varlen")):
        cfg = load_run_config(None, tiny_overrides(tmp_path / choice, data__valid="[]",
                                                   train__unpadded_attention=choice))
        init_process_group(env, backend="gloo", timeout_s=60)
        trainer = None
        try:
            trainer = Trainer(cfg, env)
            assert trainer.unpadded == want
            forward, seen = trainer.engine.forward, []

            def forward_seen(batch, **kwargs):
                stream = batch["packed_joint"]
                seen.append("varlen" if stream.cu_seqlens_B1 is not None and not stream.groups else "groups")
                return forward(batch, **kwargs)

            trainer.engine.forward = forward_seen
            loader = iter(trainer._loader(trainer.train_set, 0))
            prepared = next(loader)[PREPARED]  # packed by the loader (its workers), as the step would pack it
            assert prepared == trainer._step_facts() and prepared.unpadded == want and prepared.joint
            trainer.engine.train()
            for _ in range(2):
                trainer.train_step(loader)
            assert seen == [want, want]
            assert torch.isfinite(torch.tensor(trainer.window.sums.reduce(env)["loss"]))
        finally:
            if trainer is not None:
                trainer.close()
            destroy_process_group()
