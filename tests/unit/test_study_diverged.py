"""pretrain-study and a run that diverges (pretrain-train exit 3): a result, recorded, not a failure. The driver runs
its steps as real subprocesses; the trainer and pretrain-eval are stand-ins (small scripts put in place of their
modules): the trainer writes a run directory (config.yaml, metrics.jsonl, a checkpoint with its weights) and exits
0, or diverges like the real one (a checkpoint before the spike, the ``pretrain-train: loss spike at step N ...``
line, exit 3), or fails otherwise; each launch is counted."""

from __future__ import annotations

import json
import math
import shutil
import statistics
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STS = ("STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness")

STUDY = """
name: d
shared:
  overrides: [train.max_steps=4]
arms:
  - {name: a, config: configs/quickstart.yaml, seeds: [1, 2, 3]}
  - {name: b, config: configs/quickstart.yaml, overrides: [optim.lr=5.0e-4], seeds: [1]}
  - {name: c, config: configs/quickstart.yaml, overrides: ["checkpoint.init_from={run:a}"], seeds: [2]}
evaluations:
  runs: [{name: sts, tool: pretrain-eval, args: [--suites, sts]}]
tables:
  - {kind: sts, title: STS, evals: [sts]}
  - {kind: training, title: Dyn, evals: [sts]}
"""

TRAIN = r'''
import json, os, struct, sys
from pathlib import Path

args = dict(a.split("=", 1) for a in sys.argv[2:] if "=" in a)
run, seed, max_steps = Path(args["run_dir"]), int(args["seed"]), int(args["train.max_steps"])
with open(os.environ["STANDIN_LAUNCHES"], "a") as f:
    f.write(f"train {run.name}\n")
run.mkdir(parents=True, exist_ok=True)
(run / "config.yaml").write_text(f"train:\n  max_steps: {max_steps}\n")


def checkpoint(step):
    tag = run / "checkpoints" / f"step_{step:08d}"
    tag.mkdir(parents=True, exist_ok=True)
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}).encode()
    (tag / "model.safetensors").write_bytes(len(header).to_bytes(8, "little") + header + struct.pack("<f", seed))
    (tag / "trainer_state.json").write_text(json.dumps({"format_version": 3, "step": step}))


code = json.loads(os.environ.get("STANDIN_EXIT") or "{}").get(run.name, 0)
records = [{"step": s, "split": "train", "nt_xent": 0.5 + 0.1 * seed} for s in (1, 2)]
records.append({"step": 2, "split": "valid", "mlm": 7.0 + seed})
checkpoint(2)
if code == 3:
    records.append({"step": 2, "split": "rollback", "trigger_step": 3, "reason": "loss spike"})
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    print("rollback: loss spike at step 3; back to step_00000002", flush=True)
    print("pretrain-train: loss spike at step 3: loss 9.1 is 4.0x the median 2.3; the run was rolled back to "
          "step_00000002 2 times already (train.spike.max_rollbacks=2) ... Stopping.", file=sys.stderr, flush=True)
    print("closing the data loader", flush=True)
    sys.exit(3)
if code:
    print(f"pretrain-train: error: stand-in failure {code}", file=sys.stderr)
    sys.exit(0 if code == "missing" else code)
records += [{"step": s, "split": "train", "nt_xent": 0.2 + 0.1 * seed} for s in (3, 4)]
(run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
checkpoint(max_steps)
'''

EVAL = r'''
import json, os, sys
from pathlib import Path

argv = sys.argv[1:]
out, name = Path(argv[argv.index("--out") + 1]), argv[argv.index("--name") + 1]
with open(os.environ["STANDIN_LAUNCHES"], "a") as f:
    f.write(f"eval {name}\n")
code = json.loads(os.environ.get("STANDIN_EXIT") or "{}").get("eval " + name, 0)
if code:
    sys.exit(code)
arm, seed = name.rsplit("-seed", 1)
tasks = ("STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness")
score = {t: 50.0 + 3.0 * int(seed) + i + (5.0 if arm == "b" else 0.0) for i, t in enumerate(tasks)}
out.mkdir(parents=True, exist_ok=True)
sts = {t: {"spearman": {c: score[t] for c in ("all", "mean", "wmean")}} for t in tasks}
(out / "eval.json").write_text(json.dumps({"sts": sts}))
'''


def _score(seed: int, task_index: int) -> float:
    return 50.0 + 3.0 * seed + task_index


@pytest.fixture
def study(tmp_path, monkeypatch):
    """(study file, out dir, launches(): the steps launched so far, as 'train RUN' / 'eval RUN')."""
    from pretrain.study import plan

    monkeypatch.chdir(REPO)
    stand_ins = tmp_path / "stand_ins"
    stand_ins.mkdir()
    (stand_ins / "standin_train.py").write_text(TRAIN)
    (stand_ins / "standin_eval.py").write_text(EVAL)
    monkeypatch.setitem(plan.TOOLS, "pretrain-train", "standin_train")
    monkeypatch.setitem(plan.TOOLS, "pretrain-eval", "standin_eval")
    monkeypatch.setenv("PYTHONPATH", str(stand_ins))
    launches = tmp_path / "launches.txt"
    monkeypatch.setenv("STANDIN_LAUNCHES", str(launches))
    path = tmp_path / "study.yaml"
    path.write_text(STUDY)
    return path, tmp_path / "out", lambda: launches.read_text().splitlines() if launches.is_file() else []


def _exits(monkeypatch, **codes) -> None:
    """What the stand-ins do: run name (or 'eval RUN') -> exit code (3: diverge; 'missing': exit 0, no result)."""
    monkeypatch.setenv("STANDIN_EXIT", json.dumps({k.replace("_", "-").replace("eval-", "eval "): v
                                                   for k, v in codes.items()}))


def _main(path: Path, out: Path, *extra: str) -> int:
    from pretrain.study.driver import main

    return main([str(path), "--out", str(out), *extra])


def _status(out: Path) -> dict:
    return json.loads((out / "status.json").read_text())


def _row(out: Path, label: str, section: str) -> list[str]:
    body = (out / "results.md").read_text().split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    line = next(ln for ln in body.splitlines() if ln.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def _rows(out: Path, title: str) -> dict:
    table = next(t for t in json.loads((out / "results.json").read_text())["tables"] if t["title"] == title)
    return {row["label"]: row for row in table["rows"]}


# ------------------------------------------------------------------------------------------------ the first time

def test_a_diverged_run_is_recorded_and_the_study_goes_on(study, monkeypatch, capsys):
    """Exit 3 of a run stopped the whole study (StudyError, exit 1): every later arm waited on a recipe that
    diverges. It is recorded as diverged at the trainer's step; its evaluation and the run starting from it are
    skipped as blocked by it; the other arms run; the study ends 0 and its summary line names the divergence."""
    path, out, launches = study
    _exits(monkeypatch, a_seed2=3)
    assert _main(path, out) == 0
    assert launches() == ["train a-seed1", "eval a-seed1", "train a-seed2", "train a-seed3", "eval a-seed3",
                          "train b-seed1", "eval b-seed1"]
    steps = _status(out)["steps"]
    rec = steps["train/a-seed2"]
    assert rec["state"] == "diverged" and rec["rc"] == 3 and rec["diverged_at"] == 3, rec
    assert rec["message"].startswith("loss spike at step 3: loss 9.1"), rec
    for blocked in ("eval/a-seed2/sts", "train/c-seed2", "eval/c-seed2/sts"):
        assert steps[blocked]["state"] == "blocked" and steps[blocked]["blocked_by"] == ["train/a-seed2"], blocked
    assert all(steps[s]["state"] == "done" for s in ("train/a-seed1", "eval/a-seed3/sts", "eval/b-seed1/sts"))
    status = _status(out)
    inv = status["invocations"][-1]
    assert inv["diverged"] == ["train/a-seed2"] and len(inv["blocked"]) == 3 and inv["result"].startswith("ok, 1 run")
    assert status["totals"]["runs_diverged"] == 1
    printed = capsys.readouterr().out
    assert "diverged at step 3 (exit 3): loss spike at step 3" in printed
    summary = printed.strip().splitlines()[-1]
    assert "1 run(s) diverged (train/a-seed2 at step 3; 3 step(s) needing them skipped" in summary, summary

    # The tables: the diverged seed counted as such, the cells over the seeds that finished.
    sts = _rows(out, "STS")["a"]
    for i, task in enumerate(STS):
        finished = [_score(s, i) for s in (1, 3)]
        assert sts["cells"][task]["n"] == 2
        assert math.isclose(sts["cells"][task]["mean"], statistics.fmean(finished))
        assert math.isclose(sts["cells"][task]["std"], statistics.stdev(finished))
    avgs = [statistics.fmean(_score(s, i) for i in range(len(STS))) for s in (1, 3)]
    assert math.isclose(sts["cells"]["Avg."]["mean"], statistics.fmean(avgs))
    assert sts["diverged"] == [{"seed": 2, "step": 3}] and sts["seeds"] == {"done": 2, "of": 3}
    row = _row(out, "a", "STS")
    assert row[-1] == "2/3 (1 diverged)", row
    assert row[-2] == f"{statistics.fmean(avgs):.2f} ± {statistics.stdev(avgs):.2f}", row
    assert _row(out, "b", "STS")[-1] == "1/1"
    assert _row(out, "c", "STS")[1:] == ["–"] * (len(STS) + 1) + ["0/1 (1 blocked by a divergence)"]
    assert _rows(out, "STS")["c"]["blocked"] == [2] and _rows(out, "STS")["c"]["diverged"] == []
    dyn = _row(out, "a", "Dyn")
    assert dyn[1] == "1, diverged at step 3, 1" and dyn[-1] == "2/3 (1 diverged) (step 4, 4)", dyn
    finals = [0.2 + 0.1 * s for s in (1, 3)]
    assert math.isclose(_rows(out, "Dyn")["a"]["cells"]["final"]["mean"], statistics.fmean(finals))
    results = json.loads((out / "results.json").read_text())
    assert results["diverged"] == {"a-seed2": 3}
    assert "Runs done: 3 of 5; diverged: 1 (a-seed2 at step 3)." in (out / "results.md").read_text()


# ------------------------------------------------------------------------------------------------ later invocations

def test_a_rerun_keeps_a_diverged_run_unless_asked_to_retry(study, monkeypatch, capsys, tmp_path):
    """Each rerun resumed the diverged run, spent its compute diverging again, and stopped again: the study could
    never finish. It is kept (said once, with how to retry); --retry-diverged or moving its directory away
    relaunches it."""
    path, out, launches = study
    _exits(monkeypatch, a_seed2=3)
    assert _main(path, out) == 0
    assert launches().count("train a-seed2") == 1
    capsys.readouterr()

    assert _main(path, out) == 0
    assert launches().count("train a-seed2") == 1 and len(launches()) == 7  # nothing relaunched
    printed = capsys.readouterr().out
    kept = [ln for ln in printed.splitlines() if "a-seed2" in ln and "kept as diverged" in ln]
    assert len(kept) == 1 and "--retry-diverged" in kept[0] and "runs/a-seed2 away" in kept[0], printed
    inv = _status(out)["invocations"][-1]
    assert inv["ran"] == [] and inv["diverged"] == ["train/a-seed2"]
    assert _row(out, "a", "STS")[-1] == "2/3 (1 diverged)"

    assert _main(path, out, "--dry-run") == 0
    plan = capsys.readouterr().out
    assert "[diverged] train/a-seed2 (at step 3, on" in plan and "[held] eval/a-seed2/sts" in plan, plan
    assert "[held] train/c-seed2" in plan

    assert _main(path, out, "--retry-diverged") == 0  # relaunched; it diverges again: still a result
    assert launches().count("train a-seed2") == 2 and "train c-seed2" not in launches()
    assert _status(out)["steps"]["train/a-seed2"]["state"] == "diverged"

    shutil.move(out / "runs" / "a-seed2", tmp_path / "aside")  # moved away: started over
    assert _main(path, out) == 0
    assert launches().count("train a-seed2") == 3

    _exits(monkeypatch)  # retried with whatever changed, it finishes: its evaluation and the run from it follow
    assert _main(path, out, "--retry-diverged") == 0
    assert launches()[-4:] == ["train a-seed2", "eval a-seed2", "train c-seed2", "eval c-seed2"]
    steps = _status(out)["steps"]
    assert steps["train/a-seed2"]["state"] == "done" and "diverged_at" not in steps["train/a-seed2"]
    assert all(rec["state"] == "done" for rec in steps.values()), steps
    assert _row(out, "a", "STS")[-1] == "3/3" and json.loads((out / "results.json").read_text())["diverged"] == {}


def test_a_diverged_run_whose_command_changed_follows_the_usual_rules(study, monkeypatch):
    """Kept means kept as it was launched: after its arm's command changed, the run is relaunched (resumed with the
    new command, as an unfinished run is)."""
    path, out, launches = study
    _exits(monkeypatch, b_seed1=3)
    assert _main(path, out) == 0
    assert _main(path, out) == 0
    assert launches().count("train b-seed1") == 1
    path.write_text(STUDY.replace("overrides: [optim.lr=5.0e-4]", "overrides: [optim.lr=5.0e-4, train.log_every=2]"))
    assert _main(path, out) == 0
    assert launches().count("train b-seed1") == 2


# ------------------------------------------------------------------------------------------------ other failures

@pytest.mark.parametrize("codes, message", [
    ({"a_seed2": 2}, "train/a-seed2 failed (exit 2): pretrain-train: error: stand-in failure 2"),
    ({"a_seed2": "missing"}, "train/a-seed2 failed (it exited 0 but its result is missing)"),
    ({"eval_a_seed2": 3}, "eval/a-seed2/sts failed (exit 3)"),
])
def test_any_other_failure_still_stops_the_study(codes, message, study, monkeypatch, capsys):
    """Only a run's exit 3 is a result: another exit code, a result missing after exit 0, or an evaluation's exit 3
    stops the study as before."""
    path, out, launches = study
    _exits(monkeypatch, **codes)
    assert _main(path, out) == 1
    assert message in capsys.readouterr().err
    assert "train a-seed3" not in launches() and "train b-seed1" not in launches()
    status = _status(out)
    failed = [sid for sid, rec in status["steps"].items() if rec.get("state") == "failed"]
    assert failed == [message.split(" ")[0]] and status["totals"].get("runs_diverged", 0) == 0
    assert status["invocations"][-1]["result"].startswith("failed: ")


# ------------------------------------------------------------------------------------------------ the step

def test_the_step_comes_from_the_trainer_line_else_the_rollback_record(tmp_path):
    from pretrain.study.driver import divergence

    log, run = tmp_path / "x.log", tmp_path / "run"
    run.mkdir()
    log.write_text("\n=== 2026-01-01 $ old launch\npretrain-train: loss spike at step 99: old\n"
                   "\n=== 2026-01-02 $ python -m pretrain.train\nstep 10 loss 3.1\n"
                   "pretrain-train: 5 consecutive steps with a non-finite loss or gradient (last at step 12); "
                   "stopping. The last good checkpoint is step_00000010; lower optim.lr\nbye\n")
    assert divergence(log, run) == (12, "5 consecutive steps with a non-finite loss or gradient (last at step 12); "
                                        "stopping. The last good checkpoint is step_00000010; lower optim.lr")
    log.write_text("\n=== 2026-01-02 $ python -m pretrain.train\nKilled\n")
    (run / "metrics.jsonl").write_text(json.dumps({"step": 8, "split": "rollback", "trigger_step": 11}) + "\n"
                                       + json.dumps({"step": 9, "split": "train"}) + "\n{\"step\": 1")
    assert divergence(log, run) == (11, "Killed")
    (run / "metrics.jsonl").unlink()
    assert divergence(log, run) == (None, "Killed")


def test_a_study_that_starts_from_another_studys_diverged_run_says_it_diverged(study, monkeypatch, capsys, tmp_path):
    """Study e starts from study d's a-seed2, which diverged: it said "not finished: run that study first", which
    the user had done (that study finished, exit 0, and a rerun keeps the divergence); it now says the run
    diverged and how to retry it. A finished one is started from as before."""
    path, out, launches = study
    _exits(monkeypatch, a_seed2=3)
    assert _main(path, out) == 0
    user = tmp_path / "e.yaml"
    user.write_text(f"name: e\nuses: {{d: {path}}}\nshared:\n  overrides: [train.max_steps=4]\narms:\n"
                    "  - {name: x, config: configs/quickstart.yaml, seeds: [2],\n"
                    "     overrides: [\"checkpoint.init_from={run:d/a}\"]}\n")  # the same seed: a-seed2
    capsys.readouterr()
    assert _main(user, tmp_path / "e_out", "--use", f"d={out}") == 1
    err = capsys.readouterr().err
    assert "starts from d's train/a-seed2, which diverged at step 3" in err and "--retry-diverged" in err, err
    assert "not finished" not in err
    user.write_text(user.read_text().replace("seeds: [2]", "seeds: [1]"))  # a-seed1 finished
    assert _main(user, tmp_path / "e_out", "--use", f"d={out}") == 0
    assert "train x-seed1" in launches()
