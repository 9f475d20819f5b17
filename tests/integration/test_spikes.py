"""Loss spikes and bursts of non-finite steps are rolled back and their samples skipped (issue 25, item 2).

The poison is keyed by the data, as a bad region of a corpus would be: the MLM term's loss is multiplied (spike)
or made NaN whenever the micro-batch holds one of the poisoned global sample positions. A rollback that did not
skip those samples would meet them again on the replay, and the run would end in "rolled back … times already".
Real DeepSpeed engine on CPU, tiny model (ZeRO-2), in-process runs as in test_faults.py.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pretrain.objective as objective_mod
from pretrain.checkpoint import store
from pretrain.report import write_report
from pretrain.training.trainer import Trainer

SPIKE = {"train__spike__min_history": 5, "train__spike__window": 10, "data__valid": "[]", "checkpoint__every": 4}


def _main(argv: list[str], capsys) -> tuple[int, str]:
    from pretrain.train import main

    code = main(argv)
    out = capsys.readouterr()
    return code, out.out + out.err


def _poison(monkeypatch, *, positions: set[int] = frozenset(), from_call: int | None = None, kind: str = "spike"):
    """The MLM loss x30 (kind 'spike') or NaN ('nan') on micro-batches holding a global sample position in
    ``positions`` (one rank: a micro-batch is the positions [end - micro_batch_size, end)), or on every call from
    ``from_call`` on (a run that diverges whatever its data). Returns the list of poisoned calls."""
    hit, calls, poisoned = [False], [0], []
    orig_next, orig_term = Trainer._next_batch, objective_mod.OBJECTIVES["mlm"]

    def next_batch(self, loader):
        batch = orig_next(self, loader)
        end = self.train_loader.consumed_samples
        hit[0] = any(end - batch["input_ids"].shape[0] <= p < end for p in positions)
        return batch

    def term(fwd, cfg, ctx):
        loss, count, metrics = orig_term(fwd, cfg, ctx)
        calls[0] += 1  # data.valid=[]: every call is a training micro-batch
        if hit[0] or (from_call is not None and calls[0] >= from_call):
            poisoned.append(calls[0])
            loss = loss * (30.0 if kind == "spike" else float("nan"))
        return loss, count, metrics

    monkeypatch.setattr(Trainer, "_next_batch", next_batch)
    monkeypatch.setitem(objective_mod.OBJECTIVES, "mlm", term)
    return poisoned


def _records(run_dir, split="train") -> list[dict]:
    recs = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in recs if r.get("split") == split]


def _state(run_dir, step: int) -> dict:
    return store.read_trainer_state(store.checkpoints_dir(run_dir) / store.tag_for_step(step))


def test_poisoned_batch_spike_is_rolled_back_its_samples_skipped_and_resume_reproduces_it(
        tmp_path, tiny_overrides, clean_env, monkeypatch, capsys):
    run_dir = tmp_path / "spike"
    poisoned = _poison(monkeypatch, positions={101})  # a sample of step 26 (global batch 4)
    code, out = _main(tiny_overrides(run_dir, train__max_steps=32, **SPIKE), capsys)
    assert code == 0, out[-3000:]
    assert len(poisoned) == 1, "the poisoned samples were trained on again after the rollback"
    line = next(x for x in out.splitlines() if x.startswith("rollback:"))
    with capsys.disabled():
        print(f"\n{line}")
    assert "loss spike at step 26" in line and "step_00000024 (step 24)" in line, line
    assert "skipping samples 96-103 (those of steps 25-26); retry 1 of 3" in line, line
    [rec] = _records(run_dir, "rollback")
    assert rec["step"] == 24 and rec["trigger_step"] == 26 and rec["skipped_samples"] == [96, 104]
    assert rec["loss"] > 2 * rec["baseline"]
    train = _records(run_dir)
    assert [r["step"] for r in train] == list(range(1, 33))  # the undone steps 25-26 were logged once, redone
    assert max(r["loss"] for r in train[24:]) < 2 * rec["baseline"]
    # The skip is in the checkpoint rolled back to (rewritten) and in every later one.
    st24, st32 = _state(run_dir, 24), _state(run_dir, 32)
    assert st24["consumed_samples"] == 104 and [r["trigger_step"] for r in st24["rollbacks"]] == [26]
    assert st32["consumed_samples"] == 104 + 8 * 4 and st32["rollbacks"] == st24["rollbacks"]
    assert store.verify_checkpoint(store.checkpoints_dir(run_dir) / "step_00000024") == []
    report = write_report([str(run_dir)], tmp_path / "report")  # the rollback is a mark in pretrain-report
    assert "## Rollbacks" in report.markdown.read_text() and "| 26 | loss spike | 24 | 96-103 | 1 |" in \
        report.markdown.read_text()

    # A crash right after the rollback: a run directory holding only the rewritten step-24 checkpoint resumes
    # past the poisoned samples, and steps 25-32 are the uninterrupted run's, bitwise.
    again = tmp_path / "again"
    store.checkpoints_dir(again).mkdir(parents=True)
    shutil.copytree(store.checkpoints_dir(run_dir) / "step_00000024", store.checkpoints_dir(again) / "step_00000024")
    code, out = _main(tiny_overrides(again, train__max_steps=32, **SPIKE), capsys)
    assert code == 0, out[-3000:]
    assert "resumed from" in out and "rollback:" not in out
    assert len(poisoned) == 1
    assert [r["loss"] for r in _records(again)] == [r["loss"] for r in train[24:]]


def test_intermittent_nans_roll_back_and_skip(tmp_path, tiny_overrides, clean_env, monkeypatch, capsys):
    run_dir = tmp_path / "nan"
    # Steps 9, 11 and 13 (global batch 4): three non-finite steps within 10 steps; none two in a row.
    poisoned = _poison(monkeypatch, positions={33, 41, 49}, kind="nan")
    code, out = _main(tiny_overrides(run_dir, train__max_steps=20, train__spike__bad_in_window=3, **SPIKE), capsys)
    assert code == 0, out[-3000:]
    assert len(poisoned) == 3
    line = next(x for x in out.splitlines() if x.startswith("rollback:"))
    assert "non-finite steps at step 13" in line and "(at 9, 11, 13;" in line and "(step 12)" in line, line
    [rec] = _records(run_dir, "rollback")
    assert rec["step"] == 12 and rec["skipped_samples"] == [48, 52] and rec["reason"] == "non-finite steps"
    train = {r["step"]: r for r in _records(run_dir)}
    assert train[12]["bad_steps"] == 2 and train[20]["bad_steps"] == 2  # step 13's bad step was undone
    assert _state(run_dir, 20)["consumed_samples"] == 21 * 4


def test_a_spike_that_comes_back_stops_after_max_rollbacks(tmp_path, tiny_overrides, clean_env, monkeypatch,
                                                           capsys):
    run_dir = tmp_path / "diverged"
    _poison(monkeypatch, from_call=18)  # from step 18 on, whatever the data
    code, out = _main(tiny_overrides(run_dir, train__max_steps=40, train__spike__max_rollbacks=2, **SPIKE), capsys)
    assert code == 3, out[-3000:]
    lines = [x for x in out.splitlines() if x.startswith("rollback:")]
    # twice to the newest checkpoint, then twice to each older one kept (checkpoint.keep_last=3: 8, 12, 16), in case
    # the damage predated the newest; then it is not the data's
    assert len(lines) == 6 and "retry 2 of 2" in lines[1] and "Back to" in lines[2], lines
    assert "step_00000012 (step 12) (an older checkpoint: step_00000016 was rolled back to 2 times" in lines[2]
    # each fallback sets the checkpoints it gave up on aside (a requeue resumes from the fallback)
    assert "step_00000008 (step 8) (an older checkpoint: step_00000012" in lines[4]
    assert "rolled back to step_00000008 2 times already (train.spike.max_rollbacks=2)" in out
    assert "and to every older checkpoint kept as often" in out
    assert "The last good checkpoint is" in out and "lower optim.lr" in out
    records = _records(run_dir, "rollback")  # each rollback cut metrics.jsonl back: those to step 8 are left
    assert [(r["retry"], r.get("fallback_from")) for r in records] == [(1, "step_00000012"), (2, None)]
    assert store.list_complete(store.checkpoints_dir(run_dir)) == ["step_00000008"]
    aside = store.checkpoints_dir(run_dir)
    state_12 = store.read_trainer_state(aside / "abandoned_step_00000012")
    assert [r.get("fallback_from") for r in state_12["rollbacks"]] == ["step_00000016", None]
    st = store.read_trainer_state(aside / "abandoned_step_00000016")  # both skips recorded: steps 17-18 of the
    # first pass, step 17 of the second
    assert [r["skipped_samples"] for r in st["rollbacks"]] == [[64, 72], [72, 76]]


def _lasting_damage(monkeypatch, *, position: int, delay: int) -> dict:
    """A sample whose damage outlives the next checkpoint (it is in the weights and the optimizer moments, and the
    loss shows it only later): once the micro-batch holding global position ``position`` is trained, the MLM loss
    x30 from ``delay`` micro-batches on — also in every state restored from a checkpoint saved after that step,
    until a rollback restores one saved before it. Returns {"at": the step before the damaging one, or None}."""
    damage = {"at": None, "calls": 0}
    orig_next, orig_term, orig_load = Trainer._next_batch, objective_mod.OBJECTIVES["mlm"], store.load_checkpoint

    def next_batch(self, loader):
        batch = orig_next(self, loader)
        end = self.train_loader.consumed_samples
        if damage["at"] is None and end - batch["input_ids"].shape[0] <= position < end:
            damage["at"] = self.state.step  # the step about to run is the damaging one
        return batch

    def term(fwd, cfg, ctx):
        loss, count, metrics = orig_term(fwd, cfg, ctx)
        if damage["at"] is not None:
            damage["calls"] += 1
            if damage["calls"] > delay:
                loss = loss * 30.0
        return loss, count, metrics

    def load_checkpoint(engine, env, tag_dir, **kwargs):
        orig_load(engine, env, tag_dir, **kwargs)
        if damage["at"] is not None and store.step_of(Path(tag_dir).name) <= damage["at"]:
            damage.update(at=None, calls=0)  # a state from before the damage

    monkeypatch.setattr(Trainer, "_next_batch", next_batch)
    monkeypatch.setitem(objective_mod.OBJECTIVES, "mlm", term)
    monkeypatch.setattr(store, "load_checkpoint", load_checkpoint)
    return damage


def test_damage_older_than_the_newest_checkpoint_falls_back_to_an_older_one(tmp_path, tiny_overrides, clean_env,
                                                                         monkeypatch, capsys):
    """A bad batch at step 10 whose effect shows from step 14: the step-12 checkpoint (saved before the spike, so
    judged good) already holds the damage. Two rollbacks to it skip other samples and the spike comes back each
    time; then the run falls back to step 8, the newest older checkpoint kept, skips everything since (the bad
    sample among it) and trains on to the end — where it used to stop (exit 3) with an older good checkpoint on
    disk."""
    run_dir = tmp_path / "lasting"
    damage = _lasting_damage(monkeypatch, position=37, delay=3)  # position 37: step 10 (global batch 4)
    code, out = _main(tiny_overrides(run_dir, train__max_steps=24, train__spike__max_rollbacks=2, **SPIKE), capsys)
    assert code == 0, out[-3000:]
    lines = [x for x in out.splitlines() if x.startswith("rollback:")]
    assert len(lines) == 3, lines
    assert all("step_00000012 (step 12), skipping" in x for x in lines[:2]), lines
    assert "step_00000008 (step 8) (an older checkpoint: step_00000012 was rolled back to 2 times" in lines[2]
    assert damage["at"] is None  # the damaging sample was not trained again
    [rec] = _records(run_dir, "rollback")  # the fallback's (the rollbacks to 12 were cut from metrics.jsonl)
    assert rec["step"] == 8 and rec["fallback_from"] == "step_00000012" and rec["skipped_samples"][0] == 32
    train = _records(run_dir)
    assert [r["step"] for r in train] == list(range(1, 25))
    assert max(r["loss"] for r in train[8:]) < 2 * rec["baseline"]
    assert _state(run_dir, 24)["rollbacks"][-1]["fallback_from"] == "step_00000012"


def test_detector_off_trains_through_a_spike(tmp_path, tiny_overrides, clean_env, monkeypatch, capsys):
    run_dir = tmp_path / "off"
    _poison(monkeypatch, positions={41})
    code, out = _main(tiny_overrides(run_dir, train__max_steps=12, train__spike__detector="none", **SPIKE), capsys)
    assert code == 0 and "rollback:" not in out
    assert not _records(run_dir, "rollback")
