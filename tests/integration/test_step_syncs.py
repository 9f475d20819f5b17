"""The trainer's own step forces no host-device sync (pretrain/metrics/op_count.py counts the ops that would on
CUDA): a step that does not log runs forward, loss, backward and metrics without the host waiting for the
device. DeepSpeed's optimizer step (``Engine.step``: its gradient checks and norm) is counted apart: it is
DeepSpeed's, and what it syncs is reported, not asserted."""

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
from pretrain.metrics.op_count import OpCounter
from pretrain.training.trainer import Trainer


def _count_steps(trainer, steps: int) -> tuple[OpCounter, OpCounter]:
    """(ops of the trainer's steps outside Engine.step, ops of Engine.step) over ``steps`` steps after a warm-up."""
    loader = iter(trainer._loader(trainer.train_set, 0))
    trainer.engine.train()
    trainer.train_step(loader)  # warm-up: first-call work (allocations, DeepSpeed's lazy set-up) is not a step
    ds_step, inner = trainer.engine.step, OpCounter()

    def step_counted_apart():
        with _disable_current_modes(), inner:
            return ds_step()

    trainer.engine.step = step_counted_apart
    with OpCounter() as outer:
        for _ in range(steps):
            trainer.train_step(loader)
    trainer.engine.step = ds_step
    return outer, inner


@pytest.mark.slow
@pytest.mark.parametrize("zero_stage, grad_accum, cached", [(0, 1, False), (0, 2, False), (2, 1, False),
                                                            (2, 2, False), (0, 2, True), (2, 2, True)])
def test_a_step_that_does_not_log_forces_no_sync(zero_stage, grad_accum, cached, tmp_path, tiny_overrides, clean_env,
                                                  fresh_deepspeed, capsys):
    """``cached``: objective.gradient_cache (training/cached_step.py) on the same steps."""
    cfg = load_run_config(None, tiny_overrides(tmp_path / "run", data__valid="[]", distributed__zero_stage=zero_stage,
                                               train__grad_accum=grad_accum, objective__gradient_cache=cached))
    env = single_process_env()
    init_process_group(env, backend="gloo", timeout_s=60)
    trainer = None
    try:
        trainer = Trainer(cfg, env)
        outer, inner = _count_steps(trainer, steps=2)
        with capsys.disabled():
            print(f"\nZeRO-{zero_stage} grad_accum {grad_accum}{' cached' if cached else ''}, per step: "
                  f"trainer {outer.num_aten / 2:.0f} aten ops, "
                  f"{outer.num_sync / 2:g} syncs {dict(outer.syncs)}; Engine.step {inner.num_aten / 2:.0f} ops, "
                  f"{inner.num_sync / 2:g} syncs {dict(inner.syncs)}")
        assert outer.num_aten > 100  # the counter saw the step
        assert outer.num_sync == 0, dict(outer.where)
        # The metrics the step accumulated are still there, fetched in one go at the log step.
        scalars = trainer.window.sums.reduce(env)
        assert torch.isfinite(torch.tensor(scalars["loss"])) and "mlm" in scalars
    finally:
        if trainer is not None:
            trainer.close()
        destroy_process_group()
