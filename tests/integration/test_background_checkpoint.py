"""Checkpoints written in the background (checkpoint/writer.py): the same files as a synchronous save, training goes
on while they are written, a failure or crash mid-write publishes nothing, saves do not overlap, time-based saves,
and a stop signal during a save finishes that save instead of starting another. In-process tiny runs (1 rank); the
two-rank kill-and-resume of test_train_resume.py resumes from a background checkpoint."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest
from test_spikes import (
    _main,  # the trainer's main in-process, launch variables cleaned up after
)

from pretrain.checkpoint import store
from pretrain.checkpoint import writer as writer_mod
from pretrain.training import trainer as trainer_mod


def _train_steps(run_dir: Path) -> list[int]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["step"] for r in map(json.loads, lines) if r.get("split") == "train"]


def _files(tag_dir: Path) -> dict[str, bytes]:
    return {str(p.relative_to(tag_dir)): p.read_bytes() for p in sorted(tag_dir.rglob("*")) if p.is_file()}


def _hook_weights(monkeypatch, fn):
    """Run ``fn(tmp_dir, step)`` in rank 0's writer thread just before model.safetensors is consolidated."""
    real = store.write_weights

    def hooked(tmp_dir, step, **kw):
        fn(tmp_dir, step)
        return real(tmp_dir, step, **kw)

    monkeypatch.setattr(store, "write_weights", hooked)


@pytest.mark.parametrize("zero_stage", [0, 2])
def test_background_save_writes_the_files_a_synchronous_save_writes(zero_stage, tmp_path, tiny_overrides, clean_env,
                                                                     capsys):
    """Byte for byte (trainer_state.json too), every file verified in full; and resuming from the background
    checkpoint logs the same losses as the run that went on."""
    runs = {}
    for background in (True, False):
        run_dir = tmp_path / f"bg{background}"
        code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=4, checkpoint__every=2,
                                         distributed__zero_stage=zero_stage, checkpoint__background=background),
                          capsys)
        assert code == 0, out[-2000:]
        runs[background] = run_dir
    for tag in ("step_00000002", "step_00000004"):
        bg, sync = (store.checkpoints_dir(runs[b]) / tag for b in (True, False))
        assert store.verify_checkpoint(bg, full=True) == []
        bg_files, sync_files = _files(bg), _files(sync)
        assert bg_files.keys() == sync_files.keys() and "model.safetensors" in bg_files
        # config.yaml names its run_dir, files.json records the digests of config.yaml and model.safetensors, whose
        # header (its metadata map) safetensors writes in no fixed order: its tensors and metadata are compared.
        same_bytes = [n for n in bg_files if n not in ("config.yaml", "files.json", "model.safetensors")]
        assert [n for n in same_bytes if bg_files[n] != sync_files[n]] == []
        assert _weights(bg) == _weights(sync)
    first = {s: r for s, r in zip(_train_steps(runs[True]), _losses(runs[True]))}
    ckpt = store.checkpoints_dir(runs[True])
    for tag in ("step_00000004",):  # resume from the step-2 checkpoint: steps 3-4 again, bitwise
        import shutil

        shutil.rmtree(ckpt / tag)
    (ckpt / "latest").unlink()
    code, out = _main(tiny_overrides(runs[True], data__valid="[]", train__max_steps=4, checkpoint__every=2,
                                     distributed__zero_stage=zero_stage), capsys)
    assert code == 0 and "at step 2" in out, out[-2000:]
    again = {s: r for s, r in zip(_train_steps(runs[True]), _losses(runs[True]))}
    assert again == first


def _weights(tag_dir: Path) -> tuple[dict, dict]:
    from safetensors import safe_open

    with safe_open(str(tag_dir / "model.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no __iter__
        return {k: (v.dtype, v.shape, v.numpy().tobytes()) for k, v in tensors.items()}, f.metadata()


def _losses(run_dir: Path) -> list[float]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r["loss"] for r in map(json.loads, lines) if r.get("split") == "train"]


def test_training_goes_on_while_a_save_is_written_and_a_failed_write_publishes_nothing(tmp_path, tiny_overrides,
                                                                                       clean_env, monkeypatch,
                                                                                       capsys):
    """Step 4's writer waits until step 5 was logged (so training did not wait for it), checks that nothing of step
    4 is visible yet, then fails as a crash would: step 4 is never published, step 2 stays the good one, the next
    save (step 6) reports it (exit 4) and removes the partial files."""
    run_dir = tmp_path / "run"
    seen = {}

    def crash_mid_write(tmp_dir, step):
        if step != 4:
            return
        deadline = time.time() + 60
        while 5 not in _train_steps(run_dir):
            assert time.time() < deadline, "training stood still while step 4 was written"
            time.sleep(0.01)
        ckpt = tmp_dir.parent
        seen.update(latest=store.find_latest(ckpt), resumable=store.find_resumable(ckpt),
                    partial=tmp_dir.is_dir(), published=(ckpt / "step_00000004").exists())
        raise OSError("simulated crash while writing")

    _hook_weights(monkeypatch, crash_mid_write)
    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=6, checkpoint__every=2), capsys)
    assert code == 4, out[-2000:]
    assert seen == {"latest": "step_00000002", "resumable": "step_00000002", "partial": True, "published": False}
    assert "saving checkpoint step_00000004 failed (OSError: simulated crash while writing)" in out
    assert "previous checkpoint (step_00000002) is intact" in out
    ckpt = store.checkpoints_dir(run_dir)
    assert store.find_latest(ckpt) == "step_00000002" and store.verify_checkpoint(ckpt / "step_00000002") == []
    assert not any(p.name.startswith(".tmp-") for p in ckpt.iterdir()), "partial files left behind"


def test_a_new_save_waits_for_the_previous_one(tmp_path, tiny_overrides, clean_env, monkeypatch, capsys):
    """Saves every step, each writer slowed down: every snapshot starts after the previous tag was published."""
    events = []
    real_snapshot, real_publish = writer_mod.snapshot_job, store.publish

    def snapshot(*a, step, **k):
        events.append(("snapshot", step))
        return real_snapshot(*a, step=step, **k)

    def publish(ckpt_dir, tmp_dir, tag, *retention):
        time.sleep(0.2)
        real_publish(ckpt_dir, tmp_dir, tag, *retention)
        events.append(("published", int(tag.split("_")[1])))

    monkeypatch.setattr(store, "publish", publish)
    run_dir = tmp_path / "run"
    monkeypatch.setattr("pretrain.training.trainer.snapshot_job", snapshot)
    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=4, checkpoint__every=1), capsys)
    assert code == 0, out[-2000:]
    assert events == [(kind, s) for s in (1, 2, 3, 4) for kind in ("snapshot", "published")]
    assert store.list_complete(store.checkpoints_dir(run_dir)) == ["step_00000002", "step_00000003", "step_00000004"]


def test_every_minutes_saves_without_a_step_interval(tmp_path, tiny_overrides, clean_env, capsys):
    run_dir = tmp_path / "run"
    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=4, checkpoint__every=0,
                                     checkpoint__every_minutes=1e-6), capsys)
    assert code == 0, out[-2000:]
    # due after step 1 (agreed at its end), saved at step 2 (at 3 too when 60 us passed by the end of step 2); the
    # end saves 4.
    tags = store.list_complete(store.checkpoints_dir(run_dir))
    assert tags[0] == "step_00000002" and tags[-1] == "step_00000004", tags


def test_stop_signal_during_a_save_finishes_it_and_saves_nothing_more(tmp_path, tiny_overrides, clean_env,
                                                                      monkeypatch, capsys):
    """SIGTERM arrives while step 4's checkpoint is being written (training has gone on to step 5): that save is
    finished and the run exits 75 at it; no second checkpoint (of step 4 or 5) is started."""
    run_dir = tmp_path / "run"
    snapshots = []
    real_snapshot = writer_mod.snapshot_job

    def snapshot(*a, step, **k):
        snapshots.append(step)
        return real_snapshot(*a, step=step, **k)

    signalled = threading.Event()

    def signal_mid_write(tmp_dir, step):
        if step == 4:
            os.kill(os.getpid(), signal.SIGTERM)
            signalled.set()
            time.sleep(2.0)  # still writing when the trainer sees the signal (after step 4 or 5)

    real_step = trainer_mod.optimizer_step

    def optimizer_step(*a, step, **k):
        # Step 5 (step=4 done so far) starts only once the writer has signalled: on a loaded machine the writer
        # thread can be slow to reach the hook, and training must not outrun it into step 6's periodic save.
        if step == 4:
            assert signalled.wait(120), "the writer never reached step 4's weights"
        return real_step(*a, step=step, **k)

    monkeypatch.setattr("pretrain.training.trainer.snapshot_job", snapshot)
    monkeypatch.setattr(trainer_mod, "optimizer_step", optimizer_step)
    _hook_weights(monkeypatch, signal_mid_write)
    code, out = _main(tiny_overrides(run_dir, data__valid="[]", train__max_steps=8, checkpoint__every=2), capsys)
    assert code == 75, out[-2000:]
    assert snapshots == [2, 4]
    ckpt = store.checkpoints_dir(run_dir)
    assert store.find_latest(ckpt) == "step_00000004" and store.verify_checkpoint(ckpt / "step_00000004") == []
    assert f"stop signal: checkpointed step 4 ({ckpt / 'step_00000004'})" in out
    assert out.count(f"checkpoint {ckpt / 'step_00000004'}") == 1
