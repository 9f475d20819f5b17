"""Fresh-eyes review of 2026-12-07's changes: each test failed on the code before its fix."""

from __future__ import annotations

import json
from types import SimpleNamespace

from pretrain.checkpoint import store
from pretrain.config import SpikeConfig
from pretrain.training.resume import resumable_tag
from pretrain.training.spikes import Trigger, plan_rollback
from pretrain.training.state import TrainState
from pretrain.training.stop_record import requeue_allowed

ENV = SimpleNamespace(is_main=True, is_distributed=False, rank=0, world_size=1)


def test_max_stalled_1_still_requeues_a_run_that_checkpoints(tmp_path):
    """MAX_STALLED_REQUEUES=1: stop after one requeue that left the latest checkpoint where it was, not at every
    requeue (the last 1 record always has one distinct step)."""
    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    for restart in range(3):
        (ckpts / "latest").write_text(f"step_{1000 * (restart + 1):08d}\n")
        ok, why = requeue_allowed(tmp_path, max_stalled=1,
                                  environ={"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": str(restart)})
        assert ok, why
    ok, _ = requeue_allowed(tmp_path, max_stalled=1, environ={"SLURM_JOB_ID": "41", "SLURM_RESTART_COUNT": "3"})
    assert not ok  # this requeue's segment checkpointed nothing new


def _checkpoint(ckpt_dir, step: int, rollbacks_at_step: int) -> None:
    tag_dir = ckpt_dir / store.tag_for_step(step)
    tag_dir.mkdir(parents=True)
    state = TrainState(step=step, consumed_samples=4 * step, world_size=1, micro_batch_size=4, grad_accum=1,
                       requested_batch=(4, 1), seed=0, sample_stream=None, sample_order="x",
                       rollbacks=[{"step": step}] * rollbacks_at_step)
    (tag_dir / store.STATE_FILE).write_text(json.dumps(dict(state.state_dict(), format_version=store.FORMAT_VERSION,
                                                            tag=tag_dir.name)))


def test_a_requeue_after_a_fallback_resumes_from_the_fallback_not_the_abandoned_newer_checkpoint(tmp_path):
    """After the rollbacks to step 16 ran out and the run fell back to step 8, step 16 (which verifies) must not
    be what the next launch (a requeue, a crash) resumes from: that would undo the fallback and its skip."""
    ckpt_dir = store.checkpoints_dir(tmp_path)
    _checkpoint(ckpt_dir, 8, 0)
    _checkpoint(ckpt_dir, 16, 2)
    (ckpt_dir / store.LATEST_FILE).write_text("step_00000016\n")
    now = TrainState(step=18, consumed_samples=72, world_size=1, micro_batch_size=4, grad_accum=1,
                     requested_batch=(4, 1), seed=0, sample_stream=None, sample_order="x")
    tag_dir, new, record = plan_rollback(tmp_path, ENV, now, Trigger(18, "loss spike", "d"),
                                         SpikeConfig(max_rollbacks=2))
    assert tag_dir.name == "step_00000008" and record["fallback_from"] == "step_00000016"
    store.record_trainer_state(ENV, tag_dir, new.state_dict(tokens_total=0))
    assert resumable_tag(tmp_path, ENV) == "step_00000008"
