"""pretrain-study under review: what its tables show (NaN scores, duplicated seeds, results of another version of
the study), and the errors a bad study file or command line gets. Runs are fabricated as finished run directories
(config.yaml, a checkpoint at train.max_steps with its weights) and evaluations as their result files, so the real
driver skips them as done and writes its tables from them, as it does after a study ran."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
STS = ("STS12", "STS13", "STS14", "STS15", "STS16", "STSBenchmark", "SICKRelatedness")

STUDY = """
name: t
shared:
  overrides: [train.max_steps=4]
arms:
  - {name: a, config: configs/quickstart.yaml, seeds: [1, 2, 3]}
  - {name: b, config: configs/quickstart.yaml, overrides: [optim.lr=5.0e-4], seeds: [1, 2, 3]}
evaluations:
  runs:
    - {name: sts, tool: pretrain-eval, args: [--suites, "sts,align"]}
    - {name: glue, tool: pretrain-finetune-glue, args: [--tasks, "rte,mrpc"]}
tables:
  - {kind: sts, title: STS, evals: [sts]}
  - {kind: glue, title: GLUE, evals: [glue]}
  - {kind: align, title: Align, evals: [sts]}
"""


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _finished_run(out: Path, name: str, value: float, max_steps: int = 4) -> None:
    """A run directory the driver takes as finished: its newest checkpoint is at train.max_steps."""
    import torch
    from safetensors.torch import save_file

    run = out / "runs" / name
    _write(run / "config.yaml", f"train:\n  max_steps: {max_steps}\n")
    tag = run / "checkpoints" / f"step_{max_steps:08d}"
    _write(tag / "trainer_state.json", json.dumps({"format_version": 3, "step": max_steps}))
    save_file({"w": torch.full((2,), value)}, str(tag / "model.safetensors"))


def _sts_result(out: Path, name: str, scores: dict, align=(0.2, -2.0)) -> None:
    """eval.json as pretrain-eval writes it (strict JSON: an undefined correlation is null)."""
    sts = {t: {"spearman": {c: scores[t] for c in ("all", "mean", "wmean")}} for t in scores}
    _write(out / "evals" / name / "sts" / "eval.json",
           json.dumps({"sts": sts, "align_uniform": {"align": align[0], "uniform": align[1]}}))


def _glue_result(out: Path, name: str, scores: dict) -> None:
    _write(out / "evals" / name / "glue" / "results.json", json.dumps({t: {"score": s} for t, s in scores.items()}))


def _every_run_finished(out) -> None:
    """Every run of STUDY's arms a and b finished, with its STS and GLUE results (the loss, the scores by seed)."""
    for arm in ("a", "b"):
        for seed in (1, 2, 3):
            _finished_run(out, f"{arm}-seed{seed}", float(seed))
            _sts_result(out, f"{arm}-seed{seed}", _scores(seed, arm))
            _glue_result(out, f"{arm}-seed{seed}", {"RTE": 55.0})


def _study(tmp_path, text=STUDY) -> Path:
    return _write(tmp_path / "study.yaml", text)


def _main(study: Path, out: Path, *extra: str) -> int:
    from pretrain.study.driver import main

    return main([str(study), "--out", str(out), *extra])


def _cells(out: Path, title: str) -> dict:
    table = next(t for t in json.loads((out / "results.json").read_text())["tables"] if t["title"] == title)
    return {row["label"]: row["cells"] for row in table["rows"]}


def _row(out: Path, label: str, section: str) -> list[str]:
    md = (out / "results.md").read_text()
    body = md.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
    line = next(ln for ln in body.splitlines() if ln.startswith(f"| {label} |"))
    return [c.strip() for c in line.strip("|").split("|")]


def _scores(seed: int, arm: str) -> dict:
    return {t: 50.0 + 3.0 * seed + i + (5.0 if arm == "b" else 0.0) for i, t in enumerate(STS)}


# ------------------------------------------------------------------------------------------------ NaN in a cell

def test_a_nan_score_is_counted_and_shown_not_dropped_or_a_crash(tmp_path, monkeypatch):
    """eval.json and GLUE's results.json hold an undefined score (a collapsed model's constant similarities) as
    null. The STS Avg. and GLUE Avg. summed those with floats and pretrain-study ended in a TypeError after every
    run had finished; a null task score was dropped from its cell's mean while the row still said 3/3 seeds."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    for arm in ("a", "b"):
        for seed in (1, 2, 3):
            name = f"{arm}-seed{seed}"
            _finished_run(out, name, 10.0 * seed + (arm == "b"))
            scores = _scores(seed, arm)
            if name == "a-seed3":
                scores["STS12"] = None
            _sts_result(out, name, scores, align=(0.1 * seed, None if name == "b-seed2" else -seed))
            _glue_result(out, name, {"RTE": 55.0 + seed, "MRPC": None if name == "b-seed2" else 70.0 + seed})
    assert _main(_study(tmp_path), out) == 0

    sts = _cells(out, "STS")["a"]
    finite = [_scores(s, "a")["STS12"] for s in (1, 2)]
    assert sts["STS12"]["n"] == 2 and sts["STS12"]["nan"] == 1
    assert math.isclose(sts["STS12"]["mean"], statistics.fmean(finite))
    assert math.isclose(sts["STS12"]["std"], statistics.stdev(finite))
    avgs = [statistics.fmean(_scores(s, "a").values()) for s in (1, 2)]  # seed 3's average is undefined
    assert sts["Avg."]["n"] == 2 and sts["Avg."]["nan"] == 1
    assert math.isclose(sts["Avg."]["mean"], statistics.fmean(avgs))
    row = _row(out, "a", "STS")
    assert row[1] == f"{statistics.fmean(finite):.2f} ± {statistics.stdev(finite):.2f} (1 NaN)", row
    assert row[2] == f"{statistics.fmean([_scores(s, 'a')['STS13'] for s in (1, 2, 3)]):.2f} ± " \
                     f"{statistics.stdev([_scores(s, 'a')['STS13'] for s in (1, 2, 3)]):.2f}"
    assert row[-1] == "3/3"

    glue = _cells(out, "GLUE")["b"]
    assert glue["MRPC"]["n"] == 2 and glue["MRPC"]["nan"] == 1 and glue["Avg"]["nan"] == 1
    assert math.isclose(glue["Avg"]["mean"], statistics.fmean([(55.0 + s + 70.0 + s) / 2 for s in (1, 3)]))
    align = _cells(out, "Align")["b"]
    assert align["uniform"]["nan"] == 1 and math.isclose(align["uniform"]["mean"], statistics.fmean([-1, -3]))
    json.loads((out / "results.json").read_text(), parse_constant=pytest.fail)  # strict JSON: no NaN literal


def test_every_table_says_its_std_is_the_sample_std(tmp_path, monkeypatch):
    """A cell over seeds is mean ± sample std (n-1); each table's note says so, not only STS's and GLUE's."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    study = STUDY.replace("  - {kind: align, title: Align, evals: [sts]}",
                          "  - {kind: align, title: Align, evals: [sts]}\n  - {kind: training, title: Dyn}")
    _every_run_finished(out)
    assert _main(_study(tmp_path, study), out) == 0
    md = (out / "results.md").read_text()
    for section in ("STS", "GLUE", "Align", "Dyn"):
        body = md.split(f"## {section}\n", 1)[1].split("\n## ", 1)[0]
        assert "sample std" in body, (section, body)


# ------------------------------------------------------------------------------------------------ which results

def test_results_of_another_version_of_an_arm_are_left_out_of_the_tables(tmp_path, monkeypatch, capsys):
    """An arm's override edited, then `--only` another arm: the edited arm's old runs and evaluations were shown
    under the new study file (whose 'what differs' table names the new value); they are left out, and said so."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    study = STUDY.replace("tables:\n  - {kind: sts, title: STS, evals: [sts]}\n  - {kind: glue, title: GLUE, "
                          "evals: [glue]}", "tables:\n  - {kind: sts, title: STS, evals: [sts]}")
    _every_run_finished(out)
    assert _main(_study(tmp_path, study), out) == 0
    assert _cells(out, "STS")["b"]["Avg."]["n"] == 3

    edited = _study(tmp_path, study.replace("optim.lr=5.0e-4", "optim.lr=2.0e-4"))
    assert _main(edited, out, "--only", "a") == 0
    capsys.readouterr()
    cells = _cells(out, "STS")
    assert cells["a"]["Avg."]["n"] == 3 and cells["b"]["Avg."] is None
    assert _row(out, "b", "STS")[-1] == "0/3"
    md = (out / "results.md").read_text()
    assert "eval/b-seed1/sts" in md and "another version of the study" in md
    assert "Runs done: 3 of 6" in md

    # Without --only the changed runs are refused, as before: the tables never get there.
    assert _main(edited, out) == 1
    assert "train/b-seed1 was done with another command" in capsys.readouterr().err


def test_an_evaluation_of_weights_that_changed_since_is_left_out(tmp_path, monkeypatch):
    """A run resumed or retrained after its evaluation: until the evaluation is redone, its numbers are of other
    weights (the driver redoes it on the next full invocation; an --only of another arm does not)."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    _every_run_finished(out)
    study = _study(tmp_path)
    assert _main(study, out) == 0
    _finished_run(out, "b-seed2", 99.0)  # new weights, not evaluated yet
    assert _main(study, out, "--only", "a") == 0
    assert _cells(out, "STS")["b"]["Avg."]["n"] == 2
    assert "eval/b-seed2/sts" in (out / "results.md").read_text()


def test_runs_done_counts_the_runs_of_the_study_as_it_is_now(tmp_path, monkeypatch):
    """status.json keeps the records of an arm taken out of the study: 'Runs done: 6 of 3' counted them."""
    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    for arm in ("a", "b"):
        for seed in (1, 2, 3):
            _finished_run(out, f"{arm}-seed{seed}", float(seed))
    no_evals = STUDY.split("evaluations:")[0]
    assert _main(_study(tmp_path, no_evals), out) == 0
    assert "Runs done: 6 of 6" in (out / "results.md").read_text()
    only_a = no_evals.replace("  - {name: b, config: configs/quickstart.yaml, overrides: [optim.lr=5.0e-4], "
                              "seeds: [1, 2, 3]}\n", "")
    assert _main(_study(tmp_path, only_a), out) == 0
    assert "Runs done: 3 of 3" in (out / "results.md").read_text()


# ------------------------------------------------------------------------------------------------ the study file

@pytest.mark.parametrize("arm, message", [
    ("{name: a, config: configs/quickstart.yaml, seeds: [1, 2, 1]}", r"arms\[0\].seeds: seed 1 is listed twice"),
    ("{name: a, config: configs/quickstart.yaml, seeds: 1234}", r"arms\[0\].seeds: expected a list of integers"),
    ("{name: a, config: configs/quickstart.yaml, seeds: [1.5]}", r"arms\[0\].seeds: expected a list of integers"),
    ("{name: a, config: configs/quickstart.yaml, seeds: [one]}", r"arms\[0\].seeds: expected a list of integers"),
    ("{name: a, seeds: [1]}", r"arms\[0\]: config is required"),
    ("{config: configs/quickstart.yaml, seeds: [1]}", r"arms\[0\]: name is required"),
])
def test_a_bad_seed_list_or_a_missing_key_is_named(arm, message, tmp_path):
    """A seed listed twice made two identical runs count as two seeds (std 0, 'n/n'); seeds: 1234 or a missing
    config: ended in a TypeError; seeds: [1.5] ran seed 1."""
    from pretrain.study.plan import StudyError, load_study

    with pytest.raises(StudyError, match=message):
        load_study(_write(tmp_path / "s.yaml", f"arms:\n  - {arm}\n"))


@pytest.mark.parametrize("block, message", [
    ("evaluations: {weight: best}", r"evaluations: unknown key\(s\) weight; valid: runs, weights"),
    ("shared: {override: [a=1]}", r"shared: unknown key\(s\) override; valid: equal, overrides"),
    ("tables: [{kind: sts, evals: sts}]", r"tables\[0\].evals: expected a list of strings"),
    ("env: [OMP_NUM_THREADS]", r"env: expected a mapping"),
    ("evaluations: {runs: [{name: sts}]}", r"evaluations.runs\[0\]: tool is required"),
])
def test_unknown_and_misshapen_keys_are_named(block, message, tmp_path):
    from pretrain.study.plan import StudyError, load_study

    text = "arms:\n  - {name: a, config: configs/quickstart.yaml, seeds: [1]}\n" + block + "\n"
    with pytest.raises(StudyError, match=message):
        load_study(_write(tmp_path / "s.yaml", text))


def test_an_equal_key_that_one_arm_lacks_is_reported_not_a_crash(tmp_path, monkeypatch):
    """shared.equal naming a key under a block one arm sets to null (objective.nt_xent.temperature with an MLM-only
    arm) ended in 'Object of type object is not JSON serializable'."""
    from pretrain.study.plan import Planner, StudyError, load_study

    monkeypatch.chdir(REPO)
    text = ("shared:\n  equal: [objective.nt_xent.temperature]\narms:\n"
            "  - {name: mlm, config: configs/quickstart.yaml, overrides: [objective.nt_xent=null], seeds: [1]}\n"
            "  - {name: clear, config: configs/quickstart.yaml, seeds: [1]}\n")
    study = load_study(_write(tmp_path / "s.yaml", text))
    with pytest.raises(StudyError, match=r"objective.nt_xent.temperature differs between arms: mlm=\(absent\), "
                                         r"clear=0.1"):
        Planner(study, tmp_path / "out", tmp_path / "data", {}).configs()


# ------------------------------------------------------------------------------------------------ the command line

@pytest.mark.parametrize("use", ["clear_small", "clear_small=", "clear_small:/elsewhere"])
def test_a_use_without_a_directory_is_an_error_not_ignored(use, tmp_path, monkeypatch, capsys):
    """--use clear_small (no =DIR) was dropped without a word: the study then read the default directory's runs."""
    monkeypatch.chdir(REPO)
    study = _study(tmp_path, STUDY.replace("name: t\n", "name: t\nuses: {clear_small: "
                                           "configs/studies/clear_small.yaml}\n"))
    assert _main(study, tmp_path / "out", "--dry-run", "--use", use) == 1
    err = capsys.readouterr().err
    assert "--use" in err and "STUDY=DIR" in err and use in err, err


# ------------------------------------------------------------------------------------------------ the recipe itself

def test_a_run_trained_with_another_recipe_is_not_taken_as_done(tmp_path, monkeypatch, capsys):
    """The driver compared a run's command only; an arm's config file (a recipe) read by path was edited since
    (configs/recipes/clear_*.yaml turned on objective.nt_xent.mean_pool_warmup_steps after Study A ran), so its
    old runs were skipped as done and tabled beside new ones under the new recipe's settings. The recipe's
    objective and optimizer settings are compared with what the run recorded in its config.yaml."""
    import yaml

    from pretrain.config import load_run_config
    from pretrain.config.loader import to_yaml

    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    study = _study(tmp_path, STUDY.split("evaluations:")[0])
    for arm in ("a", "b"):
        for seed in (1, 2, 3):
            _finished_run(out, f"{arm}-seed{seed}", float(seed))
            overrides = ["train.max_steps=4"] + (["optim.lr=5.0e-4"] if arm == "b" else [])
            cfg = load_run_config("configs/quickstart.yaml", overrides + [f"seed={seed}"])
            (out / "runs" / f"{arm}-seed{seed}" / "config.yaml").write_text(to_yaml(cfg))
    assert _main(study, out) == 0  # as recorded: done

    recorded = out / "runs" / "b-seed2" / "config.yaml"
    cfg = yaml.safe_load(recorded.read_text())
    cfg["objective"]["nt_xent"]["temperature"] = 0.05  # what the recipe said when this run was trained
    recorded.write_text(yaml.safe_dump(cfg))
    capsys.readouterr()
    assert _main(study, out) == 1
    err = capsys.readouterr().err
    assert "train/b-seed2" in err and "objective.nt_xent.temperature" in err and "0.05" in err and "0.1" in err, err
    assert _main(study, out, "--dry-run") == 0
    assert "[conflict] train/b-seed2" in capsys.readouterr().out


def test_study_a_arms_run_the_plain_cls_they_claim(monkeypatch, tmp_path):
    """clear_small.yaml's [CLS]-collapse baseline and its 'one change each' remedies: since the CLEAR recipes turned
    the mean-pooling warm-up on (80 steps at model=tiny), every CLEAR arm ran that remedy; only the mean-warmup
    arm may."""
    from pretrain.study.plan import Planner, load_study

    monkeypatch.chdir(REPO)
    configs = Planner(load_study("configs/studies/clear_small.yaml"), tmp_path, tmp_path / "data", {}).configs()
    for arm, cfg in configs.items():
        nt = cfg["objective"]["nt_xent"]
        want = None if arm == "mlm" else 200 if arm == "remedy.mean-warmup-200" else 0
        assert (nt and nt["mean_pool_warmup_steps"]) == want or (nt is None and want is None), (arm, nt)


def test_a_dry_run_reads_no_weights_whose_digest_the_study_recorded(monkeypatch, tmp_path, capsys):
    """The driver keeps each run's weights digest in status.json (keyed by size and mtime), so a rerun does not
    hash every finished run's weights again; --dry-run ignored that cache and hashed them all (a study of BERT-base
    runs: gigabytes read to print a plan)."""
    from pretrain.study import outputs

    monkeypatch.chdir(REPO)
    out = tmp_path / "out"
    _every_run_finished(out)
    study = _study(tmp_path)
    assert _main(study, out) == 0  # every step done: digests recorded
    assert len(json.loads((out / "status.json").read_text())["weights_digests"]) == 6
    opened = []

    def counting_open(path, *args, **kwargs):
        opened.append(str(path))
        return open(path, *args, **kwargs)

    monkeypatch.setattr(outputs, "open", counting_open, raising=False)
    capsys.readouterr()
    assert _main(study, out, "--dry-run") == 0
    assert "[done] train/a-seed1" in capsys.readouterr().out
    assert not [p for p in opened if p.endswith("model.safetensors")], opened
