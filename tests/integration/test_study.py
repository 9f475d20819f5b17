"""``pretrain-study`` end to end on ``configs/studies/smoke.yaml`` (real CLIs as subprocesses, real STS/GLUE data),
then what a rerun, a lost evaluation and an interrupted run redo; plus the plan and the study files, fast.
The first invocation is the ``pretrain-study`` process itself (interrupted by SIGTERM); the three after it call the
driver's ``main`` in the test's process, whose steps are the same subprocesses: each saves the ~3 s of an
interpreter's start-up and imports.

The smoke study: tokenizer and dataset preparation, 3 arms (a CLEAR pretraining arm, a SimCSE arm with 2 seeds
starting from it, a RankCSE arm distilling from the SimCSE arm's best weights), 4 optimizer steps per run, two
evaluations per run, three tables and the report.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SMOKE = "configs/studies/smoke.yaml"
ARMS = {"clear": [1], "simcse": [1, 2], "rankcse": [1]}
RUNS = [f"{a}-seed{s}" for a, seeds in ARMS.items() for s in seeds]
STEPS = {"prep/tokenizer", "prep/wiki", "report", *(f"train/{r}" for r in RUNS),
         *(f"eval/{r}/{e}" for r in RUNS for e in ("sts", "glue"))}


def _env(data_dir: Path) -> dict:
    return {**os.environ, "PRETRAIN_DATA_DIR": str(data_dir), "OMP_NUM_THREADS": "1",
            "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def _study(out: Path, capsys) -> None:
    """``pretrain-study SMOKE --out OUT`` through the driver's ``main`` in this process (the environment of ``_env``
    and the repository as the working directory set by the caller), which must end 0."""
    from pretrain.study.driver import main

    code = main([SMOKE, "--out", str(out)])
    printed = capsys.readouterr()
    assert code == 0, f"--- stdout\n{printed.out[-3000:]}\n--- stderr\n{printed.err[-3000:]}"


def _status(out: Path) -> dict:
    return json.loads((out / "status.json").read_text())


def _tables(markdown: str) -> dict[str, list[list[str]]]:
    """Section title -> body rows (cells) of the first markdown table under it."""
    tables, title, rows = {}, None, None
    for line in markdown.splitlines():
        if line.startswith("## "):
            title, rows = line[3:].strip(), None
        elif line.startswith("|") and title and title not in tables:
            rows = [] if rows is None else rows
            if not re.fullmatch(r"\|[-:|]+\|", line.replace(" ", "")):
                rows.append([c.strip() for c in line.strip("|").split("|")])
        elif rows is not None and title not in tables:
            tables[title] = rows[1:]  # drop the header
    return tables


def _numbers(cell: str) -> list[float]:
    return [float(x) for x in cell.split("±")]


@pytest.mark.slow
def test_smoke_study_end_to_end_rerun_and_resume(tmp_path, data_dir, monkeypatch, capsys):
    env, out = _env(data_dir), tmp_path / "study"
    for key in ("PRETRAIN_DATA_DIR", "OMP_NUM_THREADS", "PYTHONPATH"):  # for the invocations in this process
        monkeypatch.setenv(key, env[key])
    monkeypatch.chdir(REPO)

    # 1. Interrupt the driver once the first run has finished: that run is kept, the rest continues later.
    t0 = time.perf_counter()
    driver = subprocess.Popen([sys.executable, "-m", "pretrain.study", SMOKE, "--out", str(out)], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and driver.poll() is None:
        status = out / "status.json"
        if status.is_file() and _status(out)["steps"].get("train/clear-seed1", {}).get("state") == "done":
            driver.send_signal(signal.SIGTERM)
            break
        time.sleep(0.2)
    _, err = driver.communicate(timeout=300)
    # During a step: one line naming it and its log (exit 1); between two steps: exit 130.
    assert driver.returncode in (1, 130), err
    assert re.fullmatch(r"pretrain-study: (error: interrupted during \S+ \(log \S+\.log\)|interrupted); rerun "
                        r"the same command to continue\n", err), err

    # 2. The same command finishes the study without redoing the finished run.
    _study(out, capsys)
    wall = time.perf_counter() - t0
    status = _status(out)
    assert set(status["steps"]) == STEPS
    assert all(rec["state"] == "done" for rec in status["steps"].values()), status["steps"]
    last = status["invocations"][-1]
    assert "train/clear-seed1" in last["skipped"] and "train/clear-seed1" not in last["ran"]
    assert set(last["ran"]) | {"prep/tokenizer", "prep/wiki", "train/clear-seed1"} == STEPS
    assert status["totals"]["cpu_s"] > 0 and all(rec["cpu_s"] >= 0 for rec in status["steps"].values())
    with capsys.disabled():
        print(f"smoke study: {wall:.1f} s wall for both invocations, {status['totals']['cpu_s']:.1f} CPU-s")

    # Tables: one row per arm, every cell a number (mean, or mean ± std for the 2-seed arm).
    tables = _tables((out / "results.md").read_text())
    for title in ("STS (Spearman ×100), mean ± std over seeds", "GLUE dev (reduced recipe)",
                  "Alignment / uniformity (STS-B dev)"):
        rows = tables[title]
        assert [r[0] for r in rows] == list(ARMS), rows
        for row in rows:
            assert all(len(_numbers(c)) in (1, 2) for c in row[1:-1]), row
            assert row[-1] == f"{len(ARMS[row[0]])}/{len(ARMS[row[0]])}"
        assert "±" in rows[1][1]
    assert "`data.stage`" in (out / "results.md").read_text()  # what differs between arms
    # Training dynamics: every arm's contrastive term with its chance value and the step it escaped (or never).
    rows = tables["Escape from chance, held-out MLM"]
    assert [r[0] for r in rows] == list(ARMS), rows
    for row in rows:
        assert re.fullmatch(r"(\d+|never)(, (\d+|never))*", row[1]), row
        loss, chance = re.fullmatch(r"([\d.]+(?: ± [\d.]+)?) \(([\d.]+)\)", row[2]).groups()
        assert float(chance) > 0 and _numbers(loss)
        assert row[-1].startswith(f"{len(ARMS[row[0]])}/{len(ARMS[row[0]])} (step 4")
    numbers = json.loads((out / "results.json").read_text())
    assert [t["kind"] for t in numbers["tables"]] == ["sts", "glue", "align", "training"]

    # Plots: the report overlays every run, each PNG has content.
    from matplotlib.image import imread

    report = (out / "report" / "report.md").read_text()
    pngs = sorted((out / "report").glob("*.png"))
    assert len(pngs) >= 5 and all(f"({p.name})" in report for p in pngs)
    for png in pngs:
        assert imread(png).var() > 0, png
    assert all(f"**{r}**" in report for r in RUNS)

    # 3. A rerun redoes nothing.
    _study(out, capsys)
    last = _status(out)["invocations"][-1]
    assert last["ran"] == [] and set(last["skipped"]) == STEPS, last
    assert last["wall_s"] < 20, last

    # 4. In one more invocation (each plans the whole study again): a lost evaluation of one run is redone, and
    # only it; and another run, interrupted (its final checkpoint never written), resumes from its newest
    # checkpoint, its evaluations redone exactly when its weights came out different.
    (out / "evals" / "simcse-seed1" / "sts" / "eval.json").unlink()
    ckpt = out / "runs" / "simcse-seed2" / "checkpoints"
    before = _weights(ckpt / "step_00000004")
    import shutil

    shutil.rmtree(ckpt / "step_00000004")
    (ckpt / "latest").write_text("step_00000002")
    _study(out, capsys)
    last = _status(out)["invocations"][-1]
    assert "resumed from" in (out / "logs" / "train" / "simcse-seed2.log").read_text()
    same = _same(before, _weights(ckpt / "step_00000004"))
    redone = {"eval/simcse-seed1/sts", "train/simcse-seed2"} | (
        set() if same else {"eval/simcse-seed2/sts", "eval/simcse-seed2/glue", "report"})
    assert set(last["ran"]) == redone and len(last["ran"]) == len(redone), (same, last)


def _weights(tag: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(tag / "model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)


# ------------------------------------------------------------------------------------------------ fast: the plan

def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "study.yaml"
    path.write_text(text)
    return path


BASE = """
name: t
shared:
  overrides: [optim.lr=1.0e-3, train.max_steps=4]
arms:
  - {name: a, config: configs/quickstart.yaml, seeds: [1]}
  - name: b
    config: configs/quickstart.yaml
    overrides: ["checkpoint.init_from={run:a}", "objective.nt_xent.temperature=0.05"]
    seeds: [1, 2]
evaluations:
  runs: [{name: sts, tool: pretrain-eval, args: [--suites, sts]}]
tables: [{kind: sts, evals: [sts]}, {kind: report}]
"""


def test_plan_orders_steps_and_resolves_references(tmp_path, monkeypatch):
    from pretrain.study.plan import Planner, load_study

    monkeypatch.chdir(REPO)
    study = load_study(_write(tmp_path, BASE))
    planner = Planner(study, tmp_path / "out", tmp_path / "data", {})
    steps = planner.steps()
    assert [s.id for s in steps] == ["train/a-seed1", "eval/a-seed1/sts", "train/b-seed1", "eval/b-seed1/sts",
                                     "train/b-seed2", "eval/b-seed2/sts", "report"]
    b2 = steps[4]
    assert b2.deps == ["train/a-seed1"]  # seed 2 starts from a's only seed
    assert f"checkpoint.init_from={tmp_path / 'out' / 'runs' / 'a-seed1'}" in b2.argv
    assert b2.argv[-2:] == ["seed=2", f"run_dir={tmp_path / 'out' / 'runs' / 'b-seed2'}"]
    assert b2.argv.index("optim.lr=1.0e-3") < b2.argv.index("objective.nt_xent.temperature=0.05")
    configs = planner.configs()
    assert configs["b"]["objective"]["nt_xent"]["temperature"] == 0.05 and configs["a"]["optim"]["lr"] == 1e-3


def test_an_arm_may_not_change_a_shared_setting_unless_it_says_so(tmp_path):
    from pretrain.study.plan import StudyError, load_study

    clash = BASE.replace('"objective.nt_xent.temperature=0.05"', '"optim.lr=5e-4"')
    with pytest.raises(StudyError, match=r"arm b sets optim.lr, a shared setting .*replaces_shared"):
        load_study(_write(tmp_path, clash))
    allowed = clash.replace("    seeds: [1, 2]", "    seeds: [1, 2]\n    replaces_shared: [optim.lr]")
    assert load_study(_write(tmp_path, allowed)).arm("b").replaces_shared == ["optim.lr"]
    with pytest.raises(StudyError, match=r"unknown key\(s\) seed;"):
        load_study(_write(tmp_path, BASE.replace("seeds: [1]}", "seed: [1]}")))


def test_a_bad_config_stops_the_study_before_anything_runs(tmp_path, monkeypatch, capsys):
    from pretrain.study.driver import main

    monkeypatch.chdir(REPO)
    bad = BASE.replace('"objective.nt_xent.temperature=0.05"', '"objective.nt_xent.temprature=0.05"')
    assert main([str(_write(tmp_path, bad)), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert err.startswith("pretrain-study: error: arm b (seed 1): ") and "temprature" in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("name", ["clear_small", "seeds_small", "smoke", "modern_small"])
def test_study_files_plan_cleanly(name, monkeypatch, capsys):
    """The shipped study files: every run's config resolves, shared.equal holds, the plan prints."""
    from pretrain.study.driver import main

    monkeypatch.chdir(REPO)
    assert main([f"configs/studies/{name}.yaml", "--out", "/nonexistent/study", "--dry-run"]) == 0
    printed = capsys.readouterr().out
    assert "dry run: nothing was run" in printed and printed.count("[todo] train/") >= 3


@pytest.mark.parametrize("name", ["seeds_small", "seeds_long"])
def test_every_arm_of_a_sentence_study_fits_the_checkpoint_it_starts_from(name, monkeypatch, tmp_path):
    """Each run's checkpoint.init_from takes the start's architecture; a model.* setting the run states (a recipe
    written for BERT-/RoBERTa-base, or the study's shared overrides) must agree with the start's, or the run stops at
    once. Checked here against the start arm's own resolved config (the SARCSE recipe's RoBERTa max_position=514
    against the tiny start's 512 stopped seeds_long's sarcse arm until 2026-12-07), without training anything."""
    from types import SimpleNamespace

    from pretrain.config import load_run_config
    from pretrain.config.model import ModelConfig
    from pretrain.export.resolve import ARCHITECTURE_FIELDS, init_model_config
    from pretrain.study.plan import Planner, load_study

    monkeypatch.chdir(REPO)
    studies = {n: load_study(f"configs/studies/{n}.yaml") for n in ("clear_small", "mlm_long", name)}
    used = {n: (studies[n], tmp_path / n) for n in ("clear_small", "mlm_long")}
    start_study = "mlm_long" if name == "seeds_long" else "clear_small"
    start = Planner(studies[start_study], tmp_path / start_study, tmp_path / "data", used).configs()["mlm"]["model"]
    weights = SimpleNamespace(model_cfg=ModelConfig(**{**start, "vocab_size": 8192}),
                              recorded=frozenset(ARCHITECTURE_FIELDS), path="start")
    planner = Planner(studies[name], tmp_path / name, tmp_path / "data", used)
    for arm in studies[name].arms:
        config, overrides = planner.train_argv(arm, arm.seeds[0])
        cfg = load_run_config(config, overrides)
        assert cfg.checkpoint.init_from == str(tmp_path / start_study / "runs" / "mlm-seed1234")
        init_model_config(cfg.model, weights, given=cfg.given, source=f"{name}/{arm.name}")  # raises on a misfit


def test_a_failed_step_stops_the_study_with_one_line_naming_it_and_its_log(tmp_path, monkeypatch, capsys):
    from pretrain.study.driver import main

    monkeypatch.chdir(REPO)
    failing = BASE.replace("name: t\n", 'name: t\nprep:\n  - {name: tok, output: tok.json, command: '
                                        '[pretrain-tokenizer, /nonexistent/text, --out, "{output}"]}\n')
    assert main([str(_write(tmp_path, failing)), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    log = tmp_path / "out" / "logs" / "prep" / "tok.log"
    assert re.fullmatch(rf"pretrain-study: error: prep/tok failed \(exit 2\): .*/nonexistent/text.* — log: {log}\n",
                        err), err
    status = json.loads((tmp_path / "out" / "status.json").read_text())
    assert status["steps"]["prep/tok"]["state"] == "failed" and "train/a-seed1" not in status["steps"]
    assert status["invocations"][-1]["result"].startswith("failed: prep/tok failed")
