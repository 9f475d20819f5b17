"""The trainer's step on a GPU never waits for the device (issue 24 item 2, checked where the CPU cannot see it).

tests/integration/test_step_syncs.py counts the aten ops that would force a host-device sync, on the CPU, under a
dispatch mode. What that cannot see: device-to-host and pageable host-to-device copies, a kernel library's own
stream synchronize (aten's embedding backward past ~4k ids once sorted through Thrust, pytorch/pytorch#82886),
DeepSpeed's CUDA-only code and the direct flash attention of ``train.unpadded_attention=varlen``. Here the
trainer's own step runs on the device under ``torch.cuda.set_sync_debug_mode("error")``, which raises at the first
synchronizing CUDA call with its stack: two non-logging steps after a warm-up one, at micro-batches of 64 rows of
64 tokens and two views of 32 (about 7,400 real tokens in the joint stream, past the 3,072-4,096 ids where aten's
embedding backward starts sorting).

``PRETRAIN_GPU_TEST_DEVICE=cpu`` runs the steps on the CPU without the sync check (a check of the test itself).
"""

from __future__ import annotations

import os

import pytest
import torch

from pretrain.config import load_run_config
from pretrain.distributed.env import destroy_process_group, init_process_group, single_process_env
from pretrain.distributed.engine import accelerator_syncs
from pretrain.training.trainer import Trainer

pytestmark = pytest.mark.gpu

ON_CUDA = os.environ.get("PRETRAIN_GPU_TEST_DEVICE", "cuda") == "cuda"


@pytest.mark.parametrize("precision, zero_stage, layout", [("bf16", 2, "auto"), ("bf16", 2, "varlen"),
                                                           ("fp32", 0, "auto")])
def test_the_trainers_step_never_waits_for_the_device(precision, zero_stage, layout, tmp_path, tiny_overrides,
                                                      clean_env):
    """Where the Engine decides the skip on the device (fp32 at ZeRO 0-2, bf16 at ZeRO 1-2: ds_config.checks_on_device),
    a step that does not log issues no synchronizing CUDA call: loader batch to the device through pinned memory,
    forward, losses, backward, DeepSpeed's reduction and the fused AdamW update. ``layout``: the unpadded
    attention (auto: groups, one SDPA per group of rows; varlen: aten's flash attention over the cumulative lengths)."""
    cfg = load_run_config(None, tiny_overrides(tmp_path / "run", data__valid="[]", distributed__zero_stage=zero_stage,
                                               train__precision=precision, train__unpadded_attention=layout,
                                               train__micro_batch_size=64, model__hidden_size=64))
    env = single_process_env()
    init_process_group(env, backend="auto", timeout_s=120)
    trainer = None
    try:
        trainer = Trainer(cfg, env)
        assert torch.device(trainer.engine.device).type == ("cuda" if ON_CUDA else "cpu")
        loader = iter(trainer._loader(trainer.train_set, 0))
        trainer.engine.train()
        trainer.train_step(loader)  # warm-up: lazy allocations, DeepSpeed's first-step set-up
        if ON_CUDA:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:  # an explicit synchronize is no error to the debug mode: DeepSpeed's are counted apart
            with accelerator_syncs() as waits:
                for _ in range(2):
                    trainer.train_step(loader)
        finally:
            if ON_CUDA:
                torch.cuda.set_sync_debug_mode("default")
        assert not waits, f"DeepSpeed synchronized the device {len(waits)} times in 2 steps"
        scalars = trainer.window.sums.reduce(env)  # the log step's one fetch, outside the checked steps
        assert torch.isfinite(torch.tensor(scalars["loss"])) and "mlm" in scalars
    finally:
        if trainer is not None:
            trainer.close()
        destroy_process_group()
