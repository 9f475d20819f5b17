"""Review of the run's history across interruptions: what metrics.jsonl, ``pretrain-report``'s reader and
TensorBoard (its own reader of the event files) hold after a crash and a resume from an earlier checkpoint, a
rollback, and a relaunch of a run that had finished."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


def _tb(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """TensorBoard's own reading of every event file under ``tb_dir`` (its purges applied)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tb_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def _lines(run: Path) -> list[tuple[int, str]]:
    return [(r["step"], r["split"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def test_steps_redone_after_a_crash_and_a_rollback_are_held_once_by_every_reader(tmp_path):
    """The first launch logs to step 450 and dies (the step-400 checkpoint is its newest); the relaunch resumes from
    step 400, logs steps 410-500 again with other values, then a spike at step 500 rolls it back to its step-450
    checkpoint, which it trains on from. metrics.jsonl, pretrain-report's reader and TensorBoard each hold every
    step once, with the values of the launch that logged it last."""
    from pretrain.metrics.history import read_metrics
    from pretrain.metrics.writer import MetricsWriter

    run = tmp_path / "run"
    first = MetricsWriter(run)
    for step in range(10, 451, 10):
        first.log(step, {"loss": 1.0})
        if step % 50 == 0:
            first.log(step, {"mlm": 1.0}, split="valid")
    first.close()  # a kill leaves the same files: each line is one write, each event is written as it comes

    second = MetricsWriter(run, resume_step=400)
    for step in range(410, 501, 10):
        second.log(step, {"loss": 2.0})
        if step % 50 == 0:
            second.log(step, {"mlm": 2.0}, split="valid")
    second.rewind(450)
    second.log(450, {"trigger_step": 500, "retry": 1}, split="rollback")
    for step in range(460, 501, 10):
        second.log(step, {"loss": 3.0})
    second.close()

    lines = _lines(run)
    assert len(lines) == len(set(lines))
    records, notes = read_metrics(run / "metrics.jsonl")
    assert notes == []
    want = {s: 1.0 if s <= 400 else 2.0 if s <= 450 else 3.0 for s in range(10, 501, 10)}
    assert dict(zip(*records["train"].series("loss"))) == want
    assert dict(zip(*records["valid"].series("mlm"))) == {50 * k: 1.0 if k <= 8 else 2.0 for k in range(1, 10)}
    tb = _tb(run / "tb")
    assert tb["train/loss"] == sorted(want.items())
    assert tb["rollback/retry"] == [(450, 1.0)]


def test_a_relaunch_of_a_finished_run_logs_nothing_again(tmp_path, tiny_overrides, clean_env, capsys):
    """A finished run launched again with the same command (a resubmitted or chained sbatch job, a requeue that came
    after the end): it resumes at train.max_steps with no step to train. Its final validation and checkpoint records
    were appended a second time (TensorBoard: two points at that step in valid/* and checkpoint/*), and the final
    checkpoint was written again."""
    from pretrain.train import main

    run = tmp_path / "run"
    argv = tiny_overrides(run, train__max_steps=2, checkpoint__every=2)
    assert main(argv) == 0
    before = _lines(run)
    assert (2, "valid") in before
    ckpt = run / "checkpoints" / "step_00000002" / "model.safetensors"
    written = ckpt.stat().st_mtime_ns
    capsys.readouterr()
    assert main(argv) == 0
    assert _lines(run) == before and ckpt.stat().st_mtime_ns == written
    assert "done already: " in capsys.readouterr().out


def test_a_relaunch_at_max_steps_from_a_checkpoint_saved_before_the_end_finishes_the_run(tmp_path, tiny_overrides,
                                                                                       clean_env, capsys):
    """A run killed between a mid-run checkpoint and its end, relaunched with train.max_steps at that checkpoint's
    step (a user who shortened the run, a chained job's schedule): it said "done already: ... validated and saved
    there" and ended, though that step had never been validated and its checkpoint was not the final one. Now the
    relaunch validates, marks the checkpoint final and ends; a further relaunch says done already."""
    import json

    from pretrain.train import main

    run = tmp_path / "run"
    assert main(tiny_overrides(run, train__max_steps=4, checkpoint__every=2)) == 0
    assert main(tiny_overrides(run, train__max_steps=4, checkpoint__every=2)) == 0  # finished: nothing to do
    assert "done already: " in capsys.readouterr().out
    state = json.loads((run / "checkpoints" / "step_00000004" / "trainer_state.json").read_text())
    assert state["finished"] is True
    assert json.loads((run / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())["finished"] is False
    # The run as if killed after its step-2 checkpoint: the later checkpoint and records gone.
    import shutil

    shutil.rmtree(run / "checkpoints" / "step_00000004")
    (run / "checkpoints" / "latest").write_text("step_00000002\n")
    argv = tiny_overrides(run, train__max_steps=2, checkpoint__every=2)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "done already" not in out and "its final validation and checkpoint follow" in out, out
    assert [k for k in _lines(run) if k[0] == 2].count((2, "valid")) == 1  # the end's validation, once
    state = json.loads((run / "checkpoints" / "step_00000002" / "trainer_state.json").read_text())
    assert state["finished"] is True and state["step"] == 2
    assert main(argv) == 0
    assert "done already: " in capsys.readouterr().out

def test_a_save_in_flight_when_the_lock_is_taken_over_is_abandoned_not_published(tmp_path, tiny_overrides, clean_env,
                                                                                 monkeypatch):
    """Another trainer took the run directory over (a requeue of the same job while this process was still alive):
    this one stops without saving, but its close() still finished the background save in flight and published it
    into the directory the other trainer now writes (its retention, its latest, a tag the other may write too)."""
    import threading

    import torch

    from pretrain.checkpoint import store
    from pretrain.checkpoint.writer import CheckpointWriter
    from pretrain.config import load_run_config
    from pretrain.distributed.env import destroy_process_group, init_process_group, single_process_env
    from pretrain.training.run_lock import RunDirLocked
    from pretrain.training.trainer import Trainer

    go = threading.Event()
    run_save = CheckpointWriter._run

    def held(self, job):  # the save is slow: it starts writing once the test lets it
        go.wait(30)
        run_save(self, job)

    monkeypatch.setattr(CheckpointWriter, "_run", held)
    env = single_process_env()
    init_process_group(env, backend="gloo", timeout_s=60)
    run = tmp_path / "run"
    trainer = Trainer(load_run_config(None, tiny_overrides(run, checkpoint__background="true")), env)
    try:
        loader = iter(trainer._loader(trainer.train_set, 0))
        trainer.engine.train()
        trainer.train_step(loader)
        trainer.save()  # in flight, held
        trainer.lock.lost = True  # what its heartbeat sets when another trainer's lock replaced it
        with pytest.raises(RunDirLocked, match="taken over by another trainer"):
            trainer._should_stop()
    finally:
        threading.Timer(0.3, go.set).start()
        trainer.close()
        destroy_process_group()
    assert store.list_complete(store.checkpoints_dir(run)) == []
    assert not [p for p in store.checkpoints_dir(run).iterdir() if "step_00000001" in p.name]
    assert torch.distributed.is_initialized() is False
