"""pretrain-report turns real run directories into PNG plots and a markdown summary."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pretrain.report import LOSS_TERMS, main, read_metrics, write_report

pytest.importorskip("matplotlib")

RUN_COLOURS = ("#1f77b4", "#ff7f0e")  # matplotlib's C0, C1: run 0 and run 1 in every plot
EXPECTED_PNGS = {"train_loss.png", "train_mlm.png", "train_nt_xent.png", "train_cl_emb_cos.png", "lr.png", "grad_norm.png", "loss_scale.png",
                 "tokens_per_s.png", "valid_mlm.png", "valid_mlm_acc.png", "valid_cl_acc.png", "stsb_dev.png"}


def _stsb_dev(root) -> str:
    """A 12-pair STS-B dev file in the layout of the shared data directory (sts/STSBenchmark/sts-dev.csv)."""
    pairs = [("the function returns a list", "a list is returned by the function", 4.5),
             ("the module defines a class", "a class is defined in the module", 4.8),
             ("raise an error when the file is missing", "the file is missing, so an error is raised", 4.0),
             ("the loop ends at the last item", "iteration stops after the final element", 3.6),
             ("strings are immutable", "a string cannot be changed in place", 3.9),
             ("the dictionary maps keys to values", "keys are mapped to values by the dictionary", 4.6),
             ("the thread waits for the lock", "the socket closes after a timeout", 0.8),
             ("numbers can be added", "the parser reads a token", 0.2),
             ("the default value is none", "an empty list is the default", 1.5),
             ("the path is joined with a slash", "a slash joins the parts of the path", 4.1),
             ("the test passes", "the exception is caught by the handler", 0.5),
             ("the object is copied", "a copy of the object is made", 4.7)]
    d = root / "sts" / "STSBenchmark"
    d.mkdir(parents=True)
    lines = [f"main-forums\tdocs\t2026\t{i:04d}\t{y:.3f}\t{a}\t{b}" for i, (a, b, y) in enumerate(pairs)]
    (d / "sts-dev.csv").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(root)


def _train(argv: list[str]) -> None:
    """One in-process run (the next one starts as a single process: distributed.env puts the launcher variables
    back and drops DeepSpeed's old groups)."""
    from pretrain.train import main as train_main

    assert train_main(argv) == 0


def _colour_pixels(img: np.ndarray, hex_colour: str) -> int:
    want = np.array([int(hex_colour[i:i + 2], 16) / 255 for i in (1, 3, 5)])
    return int((np.abs(img[..., :3] - want).max(-1) < 0.02).sum())


def test_report_of_two_real_runs(tiny_overrides, tmp_path, clean_env, capsys):
    from matplotlib.image import imread

    a, b, out = tmp_path / "clear", tmp_path / "clear-del-word", tmp_path / "report"
    common = {"train__max_steps": 6, "train__eval_every": 3, "train__eval_batches": 1, "checkpoint__every": 0}
    _train(tiny_overrides(a, eval__stsb_every=3, eval__data_dir=_stsb_dev(tmp_path / "data"), eval__max_len=64,
                          **common))
    _train(tiny_overrides(b, data__augment__methods="del-word", optim__lr="5e-4", **common))
    with open(b / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 7, "split": "train", "lo')  # the run was killed while writing a record
    capsys.readouterr()

    assert main([str(a), str(b), "--out", str(out)]) == 0
    stdout = capsys.readouterr().out
    assert "the last line is incomplete" in stdout and "clear-del-word" in stdout

    assert {p.name for p in out.glob("*.png")} == EXPECTED_PNGS  # the absent loss terms get no plot
    for name in sorted(EXPECTED_PNGS):
        img = imread(out / name)
        assert img.ndim == 3 and img.shape[0] >= 300 and img.shape[1] >= 500, name
        assert img[..., :3].var() > 1e-4, f"{name} is blank"
        runs_drawn = [_colour_pixels(img, c) > 20 for c in RUN_COLOURS]
        assert runs_drawn == ([True, False] if name == "stsb_dev.png" else [True, True]), name

    md = (out / "report.md").read_text()
    for name in EXPECTED_PNGS:
        assert f"]({name})" in md
    assert "**clear**" in md and "**clear-del-word**" in md
    assert "hidden 32, 2 layers, 2 heads" in md and "mlm ×1 + nt_xent ×1" in md
    assert "| augmentation | del-span+reorder | del-word |" in md
    assert "| global batch | 4 (1 rank × 4 × 1 accum) |" in md and "| ZeRO stage | 2 | 2 |" in md
    assert "| steps | 6 / 6 | 6 / 6 |" in md
    best_json = json.loads((a / "best" / "best.json").read_text())
    best_cell = "" if best_json["step"] == 6 else (f"; best/ step {best_json['step']} "
                                                  f"(STS-B dev {best_json['stsb_dev_spearman']:.2f})")
    assert f"| checkpoint | step_00000006 (step 6){best_cell} | step_00000006 (step 6) |" in md
    assert f"{a}: checkpoint step_00000006 (step 6, the latest) of {a}" in stdout
    assert "0.0005, linear" in md and "| precision | fp32 | fp32 |" in md
    scores = {r["step"]: r["stsb_dev_spearman"] for r in map(json.loads, (a / "metrics.jsonl").read_text().splitlines())
              if r["split"] == "eval"}
    best_step = max(scores, key=scores.get)
    assert f"{scores[best_step]:.2f} (step {best_step})" in md
    last_valid = [json.loads(line) for line in (a / "metrics.jsonl").read_text().splitlines()
                  if '"split": "valid"' in line][-1]
    assert f"step 6: cl_acc {last_valid['cl_acc']:.4g}" in md and f"mlm {last_valid['mlm']:.4g}" in md
    assert "Not logged by: clear-del-word" in md  # STS-B dev came from run a only
    assert "`train/info_nce`" in md and "`train/reconstruction`" in md  # absent from every run, named
    assert "the last line is incomplete" in md

    assert main([str(b), "--out", str(tmp_path / "report_b")]) == 0  # a run without STS-B: no such plot
    assert not (tmp_path / "report_b" / "stsb_dev.png").exists()
    assert "`eval/stsb_dev_spearman`" in (tmp_path / "report_b" / "report.md").read_text()


def test_bad_run_directories_are_one_line_errors(tmp_path, capsys):
    missing, empty = tmp_path / "no-such-run", tmp_path / "not-a-run"
    empty.mkdir()
    for bad in (missing, empty):
        assert main([str(bad), "--out", str(tmp_path / "out")]) == 2
        captured = capsys.readouterr()
        err = captured.err.strip()
        assert len(err.splitlines()) == 1 and str(bad) in err and "Traceback" not in err, err
        assert err.startswith("pretrain-report: error:")
    assert "metrics.jsonl" in err
    assert not (tmp_path / "out").exists()


def test_metrics_reading_survives_kills_and_relaunches(tmp_path):
    path = tmp_path / "metrics.jsonl"
    rows = [{"step": s, "split": "train", "loss": 10.0 - s} for s in (1, 2, 3, 4)]
    rows += [{"step": 3, "split": "train", "loss": 0.5}, {"step": 4, "split": "train", "loss": "nan"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "not json\n" + '{"step": 5, "spl')
    records, notes = read_metrics(path)
    steps = [r["step"] for r in records["train"]]
    assert steps == [1, 2, 3, 4] and records["train"][2]["loss"] == 0.5 and np.isnan(records["train"][3]["loss"])
    assert any("last line is incomplete" in n for n in notes)
    assert any("line(s) 7 are not metrics records" in n for n in notes)
    assert any("2 record(s) superseded" in n for n in notes)


def test_loss_terms_match_the_objectives():
    from pretrain.objective.terms import OBJECTIVES

    assert LOSS_TERMS == tuple(OBJECTIVES)


def test_rollbacks_are_kept_listed_and_drawn(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    rows = [{"step": s, "split": "train", "loss": 5.0} for s in (1, 2, 3, 4, 5)]
    rows += [{"step": 4, "split": "rollback", "trigger_step": 5, "reason": "loss spike", "detail": "loss 50 is 10x",
              "skipped_samples": [16, 20], "retry": r} for r in (1, 2)]  # two rollbacks to the same checkpoint
    rows += [{"step": 5, "split": "train", "loss": 4.0}]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, _ = read_metrics(run_dir / "metrics.jsonl")
    assert [r["retry"] for r in records["rollback"]] == [1, 2] and records["train"][-1]["loss"] == 4.0
    report = write_report([str(run_dir)], tmp_path / "out")
    md = report.markdown.read_text()
    assert "## Rollbacks" in md and "| run | 5 | loss spike | 4 | 16-19 | 2 | loss 50 is 10x |" in md
    assert "| rollbacks | 2 |" in md and (tmp_path / "out" / "train_loss.png").is_file()
