"""The chaos soak's pure parts: the seeded schedule covers every fault kind, the bitwise loss comparison and the
checkpoint ledger catch what they must, the table names every fault."""

from __future__ import annotations

import json

from pretrain.training.chaos import (
    DAMAGE_FAULTS,
    FAULT_KINDS,
    STOP_FAULTS,
    CheckpointLedger,
    Fault,
    Schedule,
    compare_losses,
    fault_table,
    last_losses,
    missing_kinds,
)


def _draw(seed: int, launches: int = 12) -> list[Fault]:
    sched = Schedule(seed=seed, ckpt_every=4)
    out = []
    for launch in range(launches):
        out.append(sched.stop_fault(launch))
        damage = sched.damage_fault(launch + 1, num_complete=3)
        if damage is not None:
            out.append(damage)
    return out


def test_schedule_is_seeded_and_covers_every_kind_first():
    a, b = _draw(7), _draw(7)
    assert [(f.kind, f.after_steps, f.node, f.during_save) for f in a] == \
        [(f.kind, f.after_steps, f.node, f.during_save) for f in b]
    assert [f.kind for f in a] != [f.kind for f in _draw(8)]
    for seed in range(20):
        faults = _draw(seed)
        stops = [f.kind for f in faults if f.kind in STOP_FAULTS]
        assert sorted(stops[:len(STOP_FAULTS)]) == sorted(STOP_FAULTS), seed  # each stop kind in the first round
        assert set(DAMAGE_FAULTS) <= {f.kind for f in faults}, seed
        assert all(2 <= f.after_steps <= 10 for f in faults if f.kind in STOP_FAULTS)


def test_no_damage_without_an_older_checkpoint_to_fall_back_to():
    sched = Schedule(seed=0, ckpt_every=4)
    assert all(sched.damage_fault(i, num_complete=1) is None for i in range(50))
    assert not sched.covered()


def test_a_retried_kind_comes_next():
    sched = Schedule(seed=3, ckpt_every=4)
    first = sched.stop_fault(0)
    sched.retry(first.kind)
    assert sched.stop_fault(1).kind == first.kind


def test_compare_losses_is_bitwise_and_needs_every_step():
    ref = {1: 10.5, 2: 9.25, 3: 8.0}
    assert compare_losses(dict(ref), ref, 3) == []
    one_ulp = {**ref, 2: 9.250000000000002}
    assert compare_losses(one_ulp, ref, 3) == [("1 step(s) differ from the reference, first step 2: "
                                                "9.250000000000002 != 9.25")]
    assert compare_losses({1: 10.5, 3: 8.0}, ref, 3) == ["soak lacks steps 2"]
    assert compare_losses(ref, ref, 6) == ["soak lacks steps 4-6", "reference lacks steps 4-6"]


def test_last_record_of_a_redone_step_wins(tmp_path):
    recs = [{"step": 1, "split": "train", "loss": 3.0}, {"step": 2, "split": "train", "loss": 2.0},
            {"step": 2, "split": "train", "loss": 2.5}, {"step": 2, "split": "valid", "loss": 9.0}]
    (tmp_path / "m.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert last_losses(tmp_path / "m.jsonl") == {1: 3.0, 2: 2.5}


def _tags(*steps: int) -> list[str]:
    return [f"step_{s:08d}" for s in steps]


def test_ledger_allows_rotation_only():
    ledger = CheckpointLedger(keep_last=3)
    ledger.observe(_tags(4, 8, 12), "a")
    ledger.observe(_tags(8, 12, 16), "b")  # rotation: 4 went when 3 newer were there
    assert ledger.lost == []
    ledger.observe(_tags(8, 16), "c")  # 12 vanished with one newer
    assert ledger.lost == ["step_00000012 vanished c with only 1 newer complete checkpoint(s)"]


def test_ledger_exempts_a_deliberately_damaged_checkpoint():
    ledger = CheckpointLedger(keep_last=3)
    ledger.observe(_tags(4, 8, 12), "a")
    ledger.mark_damaged("step_00000012")
    ledger.observe(_tags(4, 8), "b")
    assert ledger.lost == []
    ledger.rewritten("step_00000012")
    ledger.observe(_tags(4, 8, 12), "c")
    ledger.observe(_tags(4, 8), "d")
    assert len(ledger.lost) == 1


def test_table_and_missing_kinds():
    faults = [Fault(kind=k, launch=i, at_step=i, at_s=1.0, outcome="fine", ok=True) for i, k in enumerate(FAULT_KINDS)]
    assert missing_kinds(faults) == []
    faults[0].ok, faults[0].outcome = None, "mounting a tmpfs needs root"
    assert missing_kinds(faults) == [FAULT_KINDS[0]]
    lines = fault_table(faults)
    assert len(lines) == 2 + len(FAULT_KINDS)
    assert "not injected: mounting a tmpfs needs root" in lines[2]
    faults[1].ok = False
    assert "**FAILED**: fine" in fault_table(faults)[3]
