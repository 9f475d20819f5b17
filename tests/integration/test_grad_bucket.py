"""ZeRO 1-2's gradient bucket is the model's size (``ds_config.reduce_bucket_size``), not DeepSpeed's 500M elements.

DeepSpeed allocates that bucket at every micro-step and frees it after the reduction; at its default, a 2 GB fp32
``torch.empty`` for any model: on the CPU a fresh mapping whose touched pages fault in at every step, on a GPU 1-2 GB
held by the caching allocator. The test watches DeepSpeed's own ``setup_buckets`` (it runs unchanged) in the
trainer's real steps and reads the bucket it allocated; with the old configuration it saw 500,000,000 elements."""

from __future__ import annotations

import pytest
import torch

from pretrain.config import load_run_config
from pretrain.distributed.ds_config import DS_REDUCE_BUCKET, reduce_bucket_size
from pretrain.distributed.env import destroy_process_group, init_process_group, single_process_env
from pretrain.training.trainer import Trainer


def test_the_bucket_is_the_models_size_up_to_deepspeeds_default():
    assert reduce_bucket_size(4_500_123) == 4_500_123
    assert reduce_bucket_size(DS_REDUCE_BUCKET + 1) == DS_REDUCE_BUCKET == 500_000_000
    assert reduce_bucket_size(0) == 1


@pytest.mark.parametrize("zero_stage, precision, grad_accum", [(1, "fp32", 1), (2, "fp32", 2), (2, "bf16", 1)])
def test_zero_allocates_a_bucket_the_size_of_the_trained_parameters(zero_stage, precision, grad_accum, tmp_path,
                                                                     tiny_overrides, clean_env, monkeypatch):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    seen: list[int] = []
    setup_buckets = DeepSpeedZeroOptimizer.setup_buckets

    def watched(self):
        allocates = not self.ready_for_gradients  # DeepSpeed calls it for every gradient; the first allocates
        setup_buckets(self)
        if allocates:
            seen.extend(buf.numel() for bucket in self.ipg_buckets.values() for buf in bucket.buffer)

    monkeypatch.setattr(DeepSpeedZeroOptimizer, "setup_buckets", watched)
    cfg = load_run_config(None, tiny_overrides(tmp_path / "run", data__valid="[]", distributed__zero_stage=zero_stage,
                                               train__grad_accum=grad_accum, train__precision=precision))
    env = single_process_env()
    init_process_group(env, backend="gloo", timeout_s=60)
    trainer = None
    try:
        trainer = Trainer(cfg, env)
        num_params = sum(p.numel() for p in trainer.module.parameters() if p.requires_grad)
        loader = iter(trainer._loader(trainer.train_set, 0))
        trainer.engine.train()
        before = [p.detach().float().clone() for p in trainer.module.parameters()]
        for _ in range(2):
            trainer.train_step(loader)
        assert trainer.engine.ds.optimizer.reduce_bucket_size == num_params
        if zero_stage == 2:  # ZeRO-2 reduces into the bucket during the backward (ZeRO-1 after it, unbucketed here)
            assert len(seen) == 2 * grad_accum, seen  # one per micro-step, freed in between
            assert set(seen) == {num_params}, (seen, num_params)
        # The steps trained (in bf16 an update can round away on a few tensors).
        changed = [not torch.equal(a, b.detach().float()) for a, b in zip(before, trainer.module.parameters())]
        assert sum(changed) > len(changed) / 2, changed
    finally:
        if trainer is not None:
            trainer.close()
        destroy_process_group()
