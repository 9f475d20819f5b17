"""GLUE fine-tuning against bad input and the benchmark's own rules: file and line of a bad row, the unlabelled test
split, NaN correlations in best-of selection, every file checked before the first run, one model and recipe per
--out, results written whole."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pretrain.eval import glue, glue_cli
from pretrain.eval.glue import FinetuneConfig, finetune
from pretrain.eval.glue_data import get_task, read_split
from test_eval_glue import BowBackbone, WordTokenizer, _tiny_bert_dir, write  # tests/unit is on sys.path

RTE_HEAD = "index\tsentence1\tsentence2\tlabel"
WORDS = "movie plot actor scene film story good bad".split()


def rte_rows(n: int = 8) -> list[str]:
    return [RTE_HEAD] + [f"{i}\tmovie plot {WORDS[6 + i % 2]}\tfilm story\t{('not_entailment', 'entailment')[i % 2]}"
                         for i in range(n)]


def test_a_bad_row_is_named_by_file_and_line(tmp_path):
    """The line an editor shows (header and blank lines counted), and an STS-B score that is not a number named too
    instead of float()'s bare "could not convert string to float: ''"."""
    write(tmp_path / "RTE/dev.tsv", [""])
    with pytest.raises(ValueError, match=r"RTE/dev\.tsv is empty"):  # was IndexError: list index out of range
        read_split(get_task("rte"), tmp_path, "dev")
    write(tmp_path / "RTE/train.tsv", [RTE_HEAD, "0\ta\tb\tentailment", "", "1\ta\tb\tentailed"])
    with pytest.raises(ValueError, match=r"RTE/train\.tsv, line 4: label 'entailed'"):
        read_split(get_task("rte"), tmp_path, "train")
    head = "index\tgenre\tfilename\tyear\told_index\tsource1\tsource2\tsentence1\tsentence2\tscore"
    for bad in ("", "n/a", "nan"):
        write(tmp_path / "STS-B/train.tsv", [head, "0\tm\tf\t2012\t0\tn\tn\tA.\tB.\t5.0",
                                             f"1\tm\tf\t2012\t1\tn\tn\tA.\tB.\t{bad}"])
        with pytest.raises(ValueError, match=rf"STS-B/train\.tsv, line 3: score '{bad}' is not a number"):
            read_split(get_task("stsb"), tmp_path, "train")


def test_the_unlabelled_test_split_is_refused_by_name(data_dir):
    """GLUE's test files carry no labels (the GLUE server scores them): asked for one, the reader says so instead of
    "row 1 has 2 columns" (CoLA) or a missing column; a split the task does not have is named with those it has."""
    with pytest.raises(ValueError, match=r"CoLA test: GLUE's test files have no labels .* reads train and dev"):
        read_split(get_task("cola"), data_dir / "glue", "test")
    with pytest.raises(ValueError, match=r"MNLI has no labelled split 'dev'; it has train, dev_matched, dev_mismatch"):
        read_split(get_task("mnli"), data_dir / "glue", "dev")


def test_a_nan_dev_score_is_never_the_best(tmp_path, monkeypatch):
    """Pearson/Spearman of constant predictions is NaN (STS-B's head early on); NaN > x is False for every x, so a
    NaN first evaluation stayed the run's best for good. It ranks below any number now."""
    scores = iter([math.nan, 50.0, 60.0, 40.0])
    monkeypatch.setattr(glue, "evaluate_dev", lambda *a, **k: {"score": next(scores)})
    write(tmp_path / "glue/SST-2/train.tsv", ["sentence\tlabel"] + [f"{WORDS[6 + i % 2]} film\t{i % 2}"
                                                                    for i in range(8)])
    write(tmp_path / "glue/SST-2/dev.tsv", ["sentence\tlabel", "good film\t1"])
    cfg = FinetuneConfig(task="sst2", lr=1e-3, batch_size=8, epochs=4, seed=1)
    res = finetune(cfg, BowBackbone(), WordTokenizer(), tmp_path / "glue", log=lambda *_: None)
    assert [h["score"] for h in res["history"]][1:] == [50.0, 60.0, 40.0]
    assert res["best"]["score"] == 60.0 and res["best"]["epoch"] == 3


def _fake_run(out: Path, lr: float, seed: int, score: float, model: str = "m", **config) -> Path:
    p = glue_cli.run_path(out, "stsb", lr, seed)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps({"task": "STS-B", "model": model, "num_train": 10, "wall_s": 1.0,
                             "config": {"lr": lr, "seed": seed, "epochs": 10, **config},
                             "best": {"score": score}}))
    return p


def test_summary_never_picks_an_lr_whose_median_is_nan(tmp_path):
    """The lr's median over seeds: NaN compares False with everything, so max() kept whichever lr came first and
    statistics.median sorted a NaN seed anywhere. NaN now counts as the lowest score."""
    _fake_run(tmp_path, 1e-5, 1, math.nan)
    _fake_run(tmp_path, 2e-5, 1, 50.0)
    assert glue_cli.summarize(tmp_path)["STS-B"]["lr"] == 2e-5
    for seed, score in ((1, 60.0), (2, math.nan), (3, 70.0)):
        _fake_run(tmp_path, 3e-5, seed, score)
    assert glue_cli.summarize(tmp_path)["STS-B"]["all_lrs"][3e-5] == 60.0  # median of (NaN, 60, 70)


def test_summary_refuses_runs_of_two_models_or_recipes(tmp_path, capsys):
    """An --out reused for another model (or batch size): results.json took the best lr over both and labelled it
    with one --name. Refused, naming the files and what differs."""
    _fake_run(tmp_path, 1e-5, 1, 70.0, model="runs/a/hf")
    _fake_run(tmp_path, 2e-5, 1, 80.0, model="runs/b/hf")
    with pytest.raises(SystemExit) as e:
        glue_cli.main(["--out", str(tmp_path), "--summarize"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "model 'runs/a/hf' vs 'runs/b/hf'" in err and err.count("\n") == 1, err
    _fake_run(tmp_path, 2e-5, 1, 80.0, model="runs/a/hf", batch_size=16)
    with pytest.raises(ValueError, match="batch_size None vs 16"):
        glue_cli.summarize(tmp_path)
    assert not (tmp_path / "results.json").exists()


def test_results_are_never_half_written(tmp_path, monkeypatch):
    """A write cut short (disk full, a kill) left half a results.json; now the old file stays until the new one is
    whole (a temporary file, then one rename)."""
    _fake_run(tmp_path, 1e-5, 1, 70.0)
    glue_cli.summarize(tmp_path)
    before = (tmp_path / "results.json").read_text()
    _fake_run(tmp_path, 1e-5, 2, 90.0)

    def half_then_fail(self, text, *a, **k):
        with open(self, "w") as f:
            f.write(text[: len(text) // 2])
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(Path, "write_text", half_then_fail)
    try:
        glue_cli.summarize(tmp_path)
    except OSError:
        pass
    after = (tmp_path / "results.json").read_text()
    assert after == before or json.loads(after)["STS-B"]["seeds"] == [1, 2]


def test_config_refuses_lengths_and_counts_that_cannot_work():
    """max_len below a pair's special tokens (0 even sliced a[:-2]: no cut at all), eval_batch_size 0 (range step 0),
    negative eval_every / max_train_examples."""
    for kw, says in (({"max_len": 3}, "finetune.max_len must be >= 4"), ({"max_len": 0}, "finetune.max_len"),
                     ({"eval_batch_size": 0}, "finetune.eval_batch_size must be positive"),
                     ({"eval_every": -1}, "finetune.eval_every must be >= 0"),
                     ({"max_train_examples": -5}, "finetune.max_train_examples must be >= 0")):
        with pytest.raises(ValueError, match=says):
            FinetuneConfig(task="rte", **kw)


@pytest.mark.parametrize("argv,says", [
    (["--tasks", "rte,squad"], "unknown GLUE task 'squad'"),
    (["--tasks", "rte", "--epochs", "0"], "finetune.epochs must be positive, got 0"),
    (["--tasks", "rte", "--lrs", "2e-5,fast"], "could not convert string to float: 'fast'"),
])
def test_cli_bad_names_and_settings_fail_in_one_line(argv, says, tmp_path, capsys):
    """Before the grid is counted (the Slurm recipe's --count-runs) and before any model is read: no traceback."""
    with pytest.raises(SystemExit) as e:
        glue_cli.main([*argv, "--out", str(tmp_path), "--count-runs"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and says in err and err.count("\n") == 1, err


def _argv(model, tmp_path, tasks="rte", lrs="1e-3"):
    return ["--model", str(model), "--tasks", tasks, "--lrs", lrs, "--epochs", "1", "--batch-size", "4",
            "--max-len", "32", "--glue-dir", str(tmp_path / "glue"), "--out", str(tmp_path / "out")]


def test_cli_checks_every_tasks_files_before_the_first_run(tmp_path, capsys):
    """--tasks rte,cola without CoLA/: RTE was fine-tuned (hours on a large task) before the error; now every file
    the grid reads is checked first and all missing ones are named."""
    model = _tiny_bert_dir(tmp_path, WORDS, max_position=64)
    write(tmp_path / "glue/RTE/train.tsv", rte_rows())
    write(tmp_path / "glue/RTE/dev.tsv", rte_rows())
    with pytest.raises(SystemExit) as e:
        glue_cli.main(_argv(model, tmp_path, tasks="rte,cola"))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert "CoLA/train.tsv" in err and "CoLA/dev.tsv" in err
    assert not list((tmp_path / "out").glob("*/*.json"))


def test_cli_names_a_malformed_row_in_one_line(tmp_path, capsys):
    model = _tiny_bert_dir(tmp_path, WORDS, max_position=64)
    write(tmp_path / "glue/RTE/train.tsv", rte_rows() + ["9\tmovie\tfilm\tyes"])
    write(tmp_path / "glue/RTE/dev.tsv", rte_rows())
    with pytest.raises(SystemExit) as e:
        glue_cli.main(_argv(model, tmp_path))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "RTE/train.tsv, line 10: label 'yes'" in err


def test_cli_keeps_one_model_and_recipe_per_out(tmp_path, capsys):
    """Runs of another model (or another batch size) in --out are refused before fine-tuning, naming the file and
    what differs; a rerun with the same settings goes on, and results.json records the model and the settings."""
    model = _tiny_bert_dir(tmp_path, WORDS, max_position=64)
    write(tmp_path / "glue/RTE/train.tsv", rte_rows())
    write(tmp_path / "glue/RTE/dev.tsv", rte_rows())
    glue_cli.main(_argv(model, tmp_path))
    summary = json.loads((tmp_path / "out/results.json").read_text())["RTE"]
    assert summary["model"] == str(model) and summary["config"]["batch_size"] == 4
    assert summary["config"]["max_len"] == 32 and summary["config"]["lr"] == 1e-3
    capsys.readouterr()
    (tmp_path / "other").mkdir()
    other = _tiny_bert_dir(tmp_path / "other", WORDS, max_position=64)
    for argv, says in ((_argv(other, tmp_path, lrs="2e-3"), "model"),
                       ([*_argv(model, tmp_path, lrs="2e-3"), "--batch-size", "8"], "batch_size 4 vs 8")):
        with pytest.raises(SystemExit) as e:
            glue_cli.main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.count("\n") == 1 and says in err and "lr0.001_seed1.json" in err, err
    assert sorted(p.name for p in (tmp_path / "out/RTE").glob("*.json")) == ["lr0.001_seed1.json"]
    glue_cli.main(_argv(model, tmp_path, lrs="1e-3,2e-3"))  # same model and recipe: more of the grid
    assert sorted(p.name for p in (tmp_path / "out/RTE").glob("*.json")) == ["lr0.001_seed1.json",
                                                                           "lr0.002_seed1.json"]


def _strict(text: str):
    """json.loads that refuses NaN/Infinity, as jq and JavaScript's JSON.parse do."""
    def refuse(name):
        raise ValueError(f"non-standard JSON literal {name}")
    return json.loads(text, parse_constant=refuse)


def test_run_files_results_and_printed_lines_are_strict_json(tmp_path, monkeypatch, capsys):
    """A NaN dev score (constant STS-B predictions) was written as the bare literal NaN, which strict JSON readers
    (jq, JSON.parse) refuse. Run files, results.json and the printed line now hold null; a null or an old file's NaN
    reads back as the lowest score."""
    model = _tiny_bert_dir(tmp_path, WORDS, max_position=64)
    write(tmp_path / "glue/RTE/train.tsv", rte_rows())
    write(tmp_path / "glue/RTE/dev.tsv", rte_rows())
    monkeypatch.setattr(glue, "evaluate_dev", lambda *a, **k: {"score": math.nan, "acc": math.nan})
    glue_cli.main(_argv(model, tmp_path))
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("{")]
    assert printed and _strict(printed[0])["best"]["score"] is None
    run = _strict((tmp_path / "out/RTE/lr0.001_seed1.json").read_text())
    assert run["best"]["score"] is None and all(h["acc"] is None for h in run["history"])
    assert _strict((tmp_path / "out/results.json").read_text())["RTE"]["score"] is None
    _fake_run(tmp_path / "sts", 1e-5, 1, math.nan)  # a file written before: the NaN literal, still read
    _fake_run(tmp_path / "sts", 2e-5, 1, 50.0)
    assert glue_cli.summarize(tmp_path / "sts")["STS-B"]["lr"] == 2e-5
    assert _strict((tmp_path / "sts/results.json").read_text())["STS-B"]["all_lrs"]["1e-05"] is None
