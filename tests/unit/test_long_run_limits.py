"""What a weeks-long run does that a short test never reaches: a resume or rollback at step ~1e6 with a long
metrics.jsonl, checkpoints left by an abandoned stretch of the run, the LR schedule and the bad-step rule far
from step 0 — each at the scale of a real run, by calling the parts directly."""

from __future__ import annotations

import errno
import json
import os

import pytest
import torch

from pretrain.checkpoint import store
from pretrain.metrics import writer as metrics_writer
from pretrain.metrics.writer import MetricsWriter


def _records(steps, *, every_ckpt: int = 1000) -> list[str]:
    """metrics.jsonl lines as the trainer appends them: a train record a step, a checkpoint record every
    ``every_ckpt`` steps (after the train record of its step)."""
    lines = []
    for s in steps:
        lines.append(json.dumps({"step": s, "split": "train", "time": 1.0, "loss": 2.5, "lr": 1e-4}) + "\n")
        if s % every_ckpt == 0:
            lines.append(json.dumps({"step": s, "split": "checkpoint", "pause_s": 0.1, "wait_prev_s": 0.0}) + "\n")
    return lines


def _kept_by_rule(text: str, step: int) -> str:
    """The rule a resume applies: whole records of steps <= ``step``, in order (-1: none)."""
    out = []
    for line in text.splitlines(keepends=True):
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if line.endswith("\n") and rec.get("step", 0) <= step:
            out.append(line)
    return "".join(out)


def test_a_resume_late_in_a_long_run_reads_only_the_records_since_its_checkpoint(tmp_path, monkeypatch):
    """A resume (or rollback) at step 59,000 of a metrics.jsonl logged every step: the records since the checkpoint
    are parsed, not the 60k before it, and the file is cut in place (same inode, no copy: works on a full disk).
    Before: every launch and rollback parsed and rewrote the whole file (O(run length), and a full disk made the
    resume itself fail)."""
    path = tmp_path / "metrics.jsonl"
    text = "".join(_records(range(1, 60_001)))
    path.write_text(text, encoding="utf-8")
    inode = os.stat(path).st_ino
    parsed = []
    real_loads = json.loads
    monkeypatch.setattr(json, "loads", lambda s, *a, **k: parsed.append(1) or real_loads(s, *a, **k))

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "replace", no_space)  # a copy of the file could not be published
    writer = MetricsWriter(tmp_path, resume_step=59_000)
    writer.close()
    monkeypatch.undo()
    assert len(parsed) <= 1_002, f"{len(parsed)} records parsed to resume 1,000 steps before the end"
    assert os.stat(path).st_ino == inode, "metrics.jsonl was rewritten, not cut in place"
    assert path.read_text(encoding="utf-8") == _kept_by_rule(text, 59_000)


@pytest.mark.parametrize("block", [7, 64, 1 << 16])
@pytest.mark.parametrize("step", [-1, 0, 3, 4, 7, 9, 10, 12])
def test_the_cut_keeps_exactly_the_records_of_steps_up_to_the_resume(tmp_path, monkeypatch, block, step):
    """Block boundaries anywhere (tiny blocks), records of one step in a row (train, checkpoint, rollback), a last
    line cut by a kill: the kept text is what the rule says (the file is in step order, as the trainer writes it)."""
    monkeypatch.setattr(metrics_writer, "TAIL_BLOCK", block, raising=False)  # the block size of the tail read
    lines = ['{"step": 0, "split": "valid", "loss": 9.0}\n', *_records(range(1, 5), every_ckpt=4),
             '{"step": 4, "split": "rollback", "trigger_step": 7}\n', *_records(range(5, 11), every_ckpt=10),
             '{"step": 10, "split": "valid", "loss": 2.0}\n', '{"step": 11, "split": "tr']
    text = "".join(lines)
    path = tmp_path / "metrics.jsonl"
    path.write_text(text, encoding="utf-8")
    metrics_writer._truncate_after_step(path, step)
    assert path.read_text(encoding="utf-8") == _kept_by_rule(text, step)


def _fake_checkpoint(ckpt_dir, step: int) -> None:
    tag = ckpt_dir / store.tag_for_step(step)
    tag.mkdir(parents=True)
    (tag / store.STATE_FILE).write_text(json.dumps({"format_version": store.FORMAT_VERSION, "step": step}))


@pytest.mark.parametrize("keep_last", [1, 2])
def test_retention_never_removes_the_checkpoint_it_just_published(tmp_path, keep_last):
    """A run resumed from step 400,000 because its newer checkpoints were damaged (a stop checkpoint at 400,537 and a
    time-based one at 400,811, both off the checkpoint.every grid) publishes step 400,300: retention must keep it. It
    counted by step number, so the damaged newer tags outranked the new one and it was removed at once — with
    ``latest`` naming it and only damaged checkpoints left to resume from."""
    ckpt_dir = store.checkpoints_dir(tmp_path)
    for step in (399_000, 400_000, 400_537, 400_811):
        _fake_checkpoint(ckpt_dir, step)
    tmp = ckpt_dir / ".tmp-step_00400300"
    tmp.mkdir()
    (tmp / store.STATE_FILE).write_text(json.dumps({"format_version": store.FORMAT_VERSION, "step": 400_300}))
    store.publish(ckpt_dir, tmp, store.tag_for_step(400_300), keep_last)
    left = store.list_complete(ckpt_dir)
    assert store.tag_for_step(400_300) in left
    # the older ones count against keep_last together with the one just published; the newer ones are left alone
    older = [t for t in left if int(t[5:]) <= 400_300]
    assert older == [store.tag_for_step(s) for s in (399_000, 400_000, 400_300)[-keep_last:]]
    assert store.tag_for_step(400_537) in left and store.tag_for_step(400_811) in left


def test_the_learning_rate_and_adamws_step_count_are_exact_at_step_one_million():
    """The schedule reads AdamW's count of applied updates (a float32 tensor, exact to 2**24 = 16.7M updates; one an
    optimizer step, not a micro-step): resumed at 999,999 it gives the last update the int schedule's lr, counts to
    1,000,000 exactly, and a vetoed update leaves the count."""
    from pretrain.config.train import OptimConfig
    from pretrain.distributed.engine import ScheduledAdamW
    from pretrain.training.optim import lr_lambda

    for schedule in ("linear", "cosine"):
        cfg = OptimConfig(lr=3e-4, warmup_steps=10_000, schedule=schedule, min_lr_ratio=0.1)
        fn = lr_lambda(cfg, 1_000_000)
        p = torch.nn.Parameter(torch.ones(4))
        opt = ScheduledAdamW([{"params": [p], "weight_decay": 0.0}], lr=cfg.lr, lr_lambda=fn)
        p.grad = torch.ones(4)
        opt.step()  # creates the state; then as loaded from a checkpoint written at step 999,999
        opt.state[p]["step"] = torch.tensor(999_999.0, dtype=torch.float32)
        assert float(opt.current_lr()) == float(torch.tensor(3e-4 * fn(999_999), dtype=torch.float32))
        opt.found_inf = torch.tensor(1.0)
        opt.step()
        assert float(opt.applied_steps()) == 999_999
        opt.found_inf = torch.tensor(0.0)
        opt.step()
        assert float(opt.applied_steps()) == 1_000_000
        assert fn(1_000_000) == pytest.approx(0.1, abs=1e-15)  # the floor from max_steps on
    assert float(torch.tensor(2.0**24, dtype=torch.float32) + 1) == 2.0**24  # where float32 would stop counting


def test_scattered_bad_steps_over_a_long_run_do_not_stop_it():
    """train.max_bad_steps counts consecutive bad steps (progress.BadSteps.run resets at a good step): a run at step
    400,000 with 10,000 bad steps behind it and one every few hundred steps goes on; 5 in a row stop it."""
    from pretrain.training.progress import BadSteps, TrainingDiverged

    bad = BadSteps(5, 10_000, lambda run, last: f"{run} in a row, last at {last}")
    for step in range(400_001, 410_001):
        bad.add(step % 300 == 0, step)
        if step % 100 == 0:
            bad.settle()
    assert bad.total == 10_000 + 33
    for step in range(410_001, 410_005):
        bad.add(True, step)
    bad.settle()
    bad.add(True, 410_005)
    with pytest.raises(TrainingDiverged, match="5 in a row, last at 410005"):
        bad.settle()


def test_keep_every_keeps_milestones_for_good_and_the_newest_keep_last(tmp_path):
    """checkpoint.keep_every: saving every 1,000 steps with keep_last=2 and keep_every=5,000, a run at step 12,000
    has the milestones 5,000 and 10,000 and the newest two (11,000, 12,000), nothing else; keep_every=0 leaves the
    newest two only. A keep_every off the checkpoint.every grid (a milestone that is never saved) is refused."""
    from pretrain.config.train import CheckpointConfig

    for keep_every, want in ((5_000, [5_000, 10_000, 11_000, 12_000]), (0, [11_000, 12_000])):
        ckpt_dir = store.checkpoints_dir(tmp_path / f"run-{keep_every}")
        ckpt_dir.mkdir(parents=True)
        for step in range(1_000, 12_001, 1_000):
            tmp = ckpt_dir / f".tmp-{store.tag_for_step(step)}"
            tmp.mkdir()
            (tmp / store.STATE_FILE).write_text(json.dumps({"format_version": store.FORMAT_VERSION, "step": step}))
            store.publish(ckpt_dir, tmp, store.tag_for_step(step), 2, keep_every)
        assert [int(t[5:]) for t in store.list_complete(ckpt_dir)] == want
    assert CheckpointConfig(every=1000, keep_every=50_000).keep_every == 50_000
    with pytest.raises(ValueError, match="multiple of checkpoint.every=1000"):
        CheckpointConfig(every=1000, keep_every=2_500)
    with pytest.raises(ValueError, match="checkpoint.every=0"):  # no periodic saves: no milestone would be kept
        CheckpointConfig(every=0, keep_every=5_000)


def _publish_with_files(ckpt_dir, step: int, keep_last: int) -> None:
    """A checkpoint with a weight file recorded in files.json (record_files), published as the writer does."""
    tmp = ckpt_dir / f".tmp-{store.tag_for_step(step)}"
    tmp.mkdir(parents=True)
    (tmp / "mp_rank_00_model_states.pt").write_bytes(bytes(range(256)) * 64 + step.to_bytes(8, "little"))
    store.record_files(tmp, {})
    (tmp / store.STATE_FILE).write_text(json.dumps({"format_version": store.FORMAT_VERSION, "step": step,
                                                    store.FILES_RECORDED: True}))
    store.publish(ckpt_dir, tmp, store.tag_for_step(step), keep_last)


def test_retention_counts_only_intact_checkpoints(tmp_path, monkeypatch):
    """keep_last=2 and the checkpoint before the newest lost a file (or a truncated one, or a flipped byte seen by a
    later process): counted, it made retention remove the last intact older checkpoint, leaving the run one
    checkpoint to resume from (and none if that one is damaged next). A damaged checkpoint does not count; it goes
    once keep_last intact ones are newer."""
    steps = lambda d: [store.step_of(t) for t in store.list_complete(d)]  # noqa: E731
    for damage in ("missing", "truncated", "flipped"):
        ckpt_dir = store.checkpoints_dir(tmp_path / damage)
        for step in (1000, 2000, 3000):
            _publish_with_files(ckpt_dir, step, 2)
        assert steps(ckpt_dir) == [2000, 3000]
        weights = ckpt_dir / store.tag_for_step(3000) / "mp_rank_00_model_states.pt"
        if damage == "missing":
            weights.unlink()
        elif damage == "truncated":
            weights.write_bytes(weights.read_bytes()[:-1])
        else:  # the same size: only the sampled digest sees it, in a process that has not verified it yet
            data = bytearray(weights.read_bytes())
            data[100] ^= 1
            weights.write_bytes(bytes(data))
            monkeypatch.setattr(store, "_VERIFIED", {}, raising=False)
        assert store.verify_checkpoint(weights.parent)
        _publish_with_files(ckpt_dir, 4000, 2)
        assert steps(ckpt_dir) == [2000, 3000, 4000], damage  # 2000 and 4000 intact; 3000 left, not counted
        assert store.find_intact(ckpt_dir)[0] == store.tag_for_step(4000)
        _publish_with_files(ckpt_dir, 5000, 2)
        assert steps(ckpt_dir) == [4000, 5000], damage  # the damaged one goes with the rest
