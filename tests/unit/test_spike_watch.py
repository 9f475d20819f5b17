"""The spike rules of training/spikes.py on their own: the loss judged against its window (ratio, zscore), the
bad-step window, the detector's state through a checkpoint."""

from __future__ import annotations

import math

import pytest
import torch

from pretrain.config import SpikeConfig
from pretrain.training.spikes import SpikeWatch, judge_loss
from pretrain.training.state import TrainState

ONE_RANK = type("Env", (), {"is_distributed": False, "world_size": 1})()


def test_ratio_detector_against_the_median():
    cfg = SpikeConfig(ratio=2.0, min_history=3, window=10)
    assert judge_loss([4.0, 3.0], 100.0, cfg) is None  # too little history to judge
    assert judge_loss([4.0, 3.0, 2.0], 5.9, cfg) is None  # < 2 x median 3
    detail, baseline = judge_loss([4.0, 3.0, 2.0], 6.1, cfg)
    assert baseline == 3.0 and "2.0x the median 3" in detail and "train.spike.ratio=2" in detail
    assert judge_loss([4.0, 3.0, 2.0], math.nan, cfg) is None  # non-finite: the bad-step rule's
    assert judge_loss([4.0, 3.0, 2.0], 100.0, SpikeConfig(detector="none", min_history=3)) is None


def test_zscore_detector_against_mean_and_std():
    cfg = SpikeConfig(detector="zscore", zscore=3.0, min_history=4, window=10)
    history = [2.0, 2.2, 1.8, 2.0]  # mean 2, std ~0.141
    assert judge_loss(history, 2.4, cfg) is None
    detail, baseline = judge_loss(history, 2.5, cfg)
    assert baseline == pytest.approx(2.0) and "standard deviations above the mean" in detail
    assert judge_loss([2.0] * 4, 9.0, cfg) is None  # no spread: nothing to measure against


def test_watch_judges_kept_losses_in_order_and_keeps_a_window():
    watch = SpikeWatch(SpikeConfig(ratio=2.0, min_history=2, window=3))
    for step, loss in enumerate([3.0, 3.0, 2.0, 2.5, 50.0, 2.0], start=1):
        watch.record(step, torch.tensor(loss), torch.tensor(False))
    trigger = watch.judge(ONE_RANK)
    assert trigger is not None and trigger.step == 5 and trigger.loss == 50.0 and trigger.reason == "loss spike"
    assert watch.losses == [3.0, 2.0, 2.5]  # the window; the spike and what came after it are not in it
    assert watch.judge(ONE_RANK) is None  # nothing kept any more


def test_bad_steps_within_the_window_trigger():
    watch = SpikeWatch(SpikeConfig(bad_in_window=3, window=5, min_history=2))
    flags = {2: True, 4: True, 9: True, 10: True, 11: True}
    fired = []
    for s in range(1, 12):  # judged every step here; a device bool per step, NaN loss where the step was bad
        watch.record(s, torch.tensor(math.nan if flags.get(s) else 2.0), torch.tensor(flags.get(s, False)))
        if watch.judge(ONE_RANK):
            fired.append(s)
    assert fired == [11]  # 2, 4 are out of the window by step 9; 9, 10, 11 are three within 5 steps
    off = SpikeWatch(SpikeConfig(bad_in_window=0, detector="none"))
    off.record(1, torch.tensor(math.nan), True)
    assert off.judge(ONE_RANK) is None  # 0 = off
    late = SpikeWatch(SpikeConfig(bad_in_window=3, window=5, min_history=2))
    for s in (9, 10, 11):  # judged only at a log step: the burst is still found, at its last step
        late.record(s, torch.tensor(math.nan), torch.tensor(True))
    assert late.judge(ONE_RANK).step == 11


def test_watch_state_goes_through_the_trainer_state():
    watch = SpikeWatch(SpikeConfig(min_history=2, window=4))
    for step, loss in enumerate([5.0, 4.0, 3.0], start=1):
        watch.record(step, torch.tensor(loss), torch.tensor(False))
    watch.record(4, torch.tensor(math.nan), torch.tensor(True))
    watch.judge(ONE_RANK)
    st = TrainState(world_size=1, micro_batch_size=4, grad_accum=1, requested_batch=(4, 1), seed=1,
                    sample_stream=None, sample_order="feistel-v1", spike_watch=watch.state_dict(),
                    rollbacks=[{"step": 4, "skipped_samples": [16, 24]}])
    back = TrainState.from_state_dict(st.state_dict(), saved={}, world_size=1)
    assert back.rollbacks == st.rollbacks
    assert SpikeWatch(watch.cfg, back.spike_watch).state_dict() == {"losses": [5.0, 4.0, 3.0], "bad_steps": [4]}
    old = TrainState.from_state_dict({"step": 8, "sample_order": "feistel-v1"}, saved={"train": {
        "micro_batch_size": 4, "grad_accum": 1}}, world_size=1)
    assert old.rollbacks == [] and old.spike_watch == {}  # a checkpoint from before spikes were watched


def test_a_loss_near_zero_must_also_rise_min_rise_nats():
    """A contrastive loss the batch has solved: 0.015 against a median of 0.005 is 3x, and a z-score far above 6 in
    a quiet window, but half a nat is what a spike must add (train.spike.min_rise): seeds_long's SARCSE seed 3
    stopped at step 56 on exactly this before the first checkpoint (exit 3)."""
    quiet = [0.005, 0.0052, 0.0049, 0.0051, 0.005]
    for detector in ("ratio", "zscore"):
        cfg = SpikeConfig(detector=detector, min_history=3, window=10)
        assert judge_loss(quiet, 0.015, cfg) is None
        assert judge_loss(quiet, 0.6, cfg) is not None  # a real jump, however low it started
        assert judge_loss(quiet, 0.015, SpikeConfig(detector=detector, min_history=3, window=10, min_rise=0))
    with pytest.raises(ValueError, match="min_rise"):
        SpikeConfig(min_rise=-1.0)
