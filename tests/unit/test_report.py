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


# -- a long history: 50k records, drawn through a bounded number of points, tables from every record ----------------

SPIKE, NAN_STEP, RELAUNCH, BEST = 23_456, 31_001, 20_000, 35_000


def _long_run(root, n: int = 50_000):
    """A run directory with ``n`` train records (train.log_every 1): one loss spike (1e4 at SPIKE), one NaN loss
    (NAN_STEP), a relaunch at RELAUNCH that did not truncate the 300 records its killed launch had logged after it,
    a rollback, and valid / eval / checkpoint records every 5000 steps (the best STS-B dev at BEST)."""
    run = root / "long"
    run.mkdir()
    rows = []

    def train(s):
        loss = 1e4 if s == SPIKE else "nan" if s == NAN_STEP else 3.0 + np.sin(s / 500) + (s % 7) / 10
        rows.append({"step": s, "split": "train", "time": 1000 + s / 2, "loss": loss, "lr": 1e-3,
                     "grad_norm": 1.0 + (s % 13) / 13, "tokens_per_s": 1400.0 + s % 11, "tokens_seen": 700 * s})

    for s in range(1, n + 1):
        train(s)
        if s % 5000 == 0:
            t = 1000 + s / 2 + 0.25
            rows += [{"step": s, "split": "valid", "time": t, "mlm": 2.5, "mlm_acc": 0.5},
                     {"step": s, "split": "eval", "time": t, "stsb_dev_spearman": 99.5 if s == BEST else 60 + s / 5000},
                     {"step": s, "split": "checkpoint", "time": t, "pause_s": 1.5}]
        if s == 40_000:
            rows.append({"step": s, "split": "rollback", "time": t, "trigger_step": s + 26, "reason": "loss spike",
                         "detail": "loss 222.4 is 23.8x the median", "skipped_samples": [160000, 160104], "retry": 1})
        if s == RELAUNCH:
            for k in range(s + 1, s + 301):
                train(k)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return run


def test_a_long_series_is_drawn_through_at_most_4000_points_and_keeps_its_spike_and_nan(tmp_path):
    """Every one of 1e6 points was drawn in each plot (~40 s, 1.8 GB at 1e6 records); now each line is decimated to
    at most 4000 points, keeping each stretch's extremes: the spike and the NaN step are still among them."""
    from pretrain.report import PLOTS, figure, load_run

    run = load_run(_long_run(tmp_path), "long")
    assert len(run.series("train", "loss")[0]) == 50_000  # the relaunch's 300 superseded records are not counted
    fig, missing, undrawn = figure(next(p for p in PLOTS if p.metric == "loss"), [run])
    line = fig.axes[0].get_lines()[0]
    x, y = np.asarray(line.get_xdata()), np.asarray(line.get_ydata(), dtype=float)
    assert 1000 < len(x) <= 4000 and (np.diff(x) > 0).all() and x[0] == 1 and x[-1] == 50_000
    assert y[x == SPIKE].tolist() == [1e4] and np.isnan(y[x == NAN_STEP]).all() and (x == NAN_STEP).any()
    assert np.nanmin(y) == min(3.0 + np.sin(s / 500) + (s % 7) / 10 for s in range(1, 50_001) if s != SPIKE)
    assert missing == [] and undrawn == {"long": (1, NAN_STEP)}


def test_decimation_keeps_each_stretchs_extremes_and_first_nan():
    from pretrain.report import decimate

    rng = np.random.default_rng(0)
    steps, values = np.arange(10, 100_010), rng.normal(size=100_000)
    values[[5, 77_777]], values[50_000], values[99_999] = np.nan, 40.0, -40.0
    x, y = decimate(steps, values, max_points=1000)
    assert len(x) <= 1000 and (np.diff(x) > 0).all() and x[0] == 10 and x[-1] == 100_009
    assert {50_010, 100_009, 15, 77_787} <= set(x.tolist()) and np.isnan(y[np.isin(x, [15, 77_787])]).all()
    for lo in range(0, 100_000, 10_000):  # every tenth of the series keeps its own lowest and highest value
        part = values[lo:lo + 10_000]
        kept = y[(x >= steps[lo]) & (x < steps[lo] + 10_000)]
        assert np.nanmax(kept) == np.nanmax(part) and np.nanmin(kept) == np.nanmin(part)
    short = decimate(steps[:1000], values[:1000], max_points=1000)
    assert short[0] is not None and len(short[0]) == 1000  # up to the bound: every point


def test_the_tables_of_a_long_run_come_from_every_record(tmp_path):
    """The plots show at most 4000 points a line; the tables still read every record: the best STS-B dev, the last
    step and tokens, the wall time, the rollback and the superseded records are exact."""
    from pretrain.report import load_run, results

    run_dir = _long_run(tmp_path)
    rows = results(load_run(run_dir, "long"))
    assert rows == {"steps": "50000", "checkpoint": "none", "tokens seen": "35.00 M", "wall time": "6 h 56 min",
                    "best STS-B dev": f"99.50 (step {BEST})", "rollbacks": "1",
                    "held-out (last)": "step 50000: mlm 2.5, mlm_acc 0.5"}
    md = write_report([str(run_dir)], tmp_path / "out").markdown.read_text()
    assert "| best STS-B dev | 99.50 (step 35000) |" in md and "| wall time | 6 h 56 min |" in md
    assert "| long | 40026 | loss spike | 40000 | 160000-160103 | 1 | loss 222.4 is 23.8x the median |" in md
    assert "300 record(s) superseded" in md and f"long: 1 value(s), the first at step {NAN_STEP}" in md


def test_the_fast_reader_reads_as_the_line_reader(tmp_path, monkeypatch):
    """Blocks of lines go through pyarrow's JSON reader; a block it cannot take as json would is read a line at a
    time. Both give the same records and notes: non-finite values, ints and floats, keys that come and go, text and
    lists, a relaunch across blocks, rollbacks sharing a step, a bad line, a torn last line."""
    from pretrain.metrics import history

    rows = []
    for s in range(1, 400):
        r = {"step": s, "split": "train", "time": 1000.0 + s, "loss": 2.0 + s % 5 / 7, "bad_steps": s // 100,
             "tokens_seen": 100 * s}
        r.update({"grad_norm": ["nan", "inf", "-inf", 1.5, 3][s % 5]} if s % 3 else {})
        r.update({"info_nce": 1} if s > 250 else {})  # an int key, later a float one
        r.update({"info_nce": 1.25} if s > 300 else {})
        rows.append(r)
        if s % 50 == 0:
            rows += [{"step": s, "split": "valid", "time": 1.0, "mlm": 2, "mlm_acc": 0.5, "flag": s % 100 == 0}]
        if s == 120:
            rows += [{"step": 100, "split": "rollback", "trigger_step": 120, "reason": "loss spike", "retry": r,
                      "detail": 'loss: "nan"', "skipped_samples": [400, 480], "loss": "nan"} for r in (1, 2)]
        if s == 200:
            rows += [{"step": k, "split": "train", "loss": 9.0} for k in range(150, 160)]  # a relaunch
        if s == 333:
            rows.append({"step": s, "split": "eval", "stsb_dev_spearman": "Infinity", "note": None})
    lines = [json.dumps(r) for r in rows]
    lines[30] = '{"step": 3.5, "split": "train"}'
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(lines) + '\n{"step": 400, "spl', encoding="utf-8")
    monkeypatch.setattr(history, "BLOCK_BYTES", 2048)
    fast, parse_arrow, took = {}, history._parse_arrow, []
    monkeypatch.setattr(history, "_parse_arrow", lambda *a: took.append(parse_arrow(*a)) or took[-1])
    fast, fast_notes = read_metrics(path)
    assert sum(t is not None for t in took) > 0.8 * len(took) > 20  # most blocks read by pyarrow
    monkeypatch.setattr(history, "_parse_arrow", lambda *a: None)
    slow, slow_notes = read_metrics(path)
    assert fast_notes == slow_notes and len(fast_notes) == 3
    assert list(fast) == list(slow) == ["train", "valid", "rollback", "eval"]
    for split in slow:
        assert json.dumps(list(fast[split]), sort_keys=True) == json.dumps(list(slow[split]), sort_keys=True), split
    train = slow["train"]
    assert [r["step"] for r in train] == [s for s in range(1, 150) if s != 31] + list(range(150, 160)) + list(
        range(201, 400))  # line 31 (step 3.5) is no record
    assert "grad_norm" not in train[2] and [train[i]["grad_norm"] for i in (0, 1, 3)] == [np.inf, -np.inf, 3]
    assert np.isnan(train[4]["grad_norm"])
    assert train[-1]["info_nce"] == 1.25 and train[-1]["tokens_seen"] == 39_900 and "info_nce" not in train[0]
    assert [r["retry"] for r in slow["rollback"]] == [1, 2] and slow["rollback"][0]["skipped_samples"] == [400, 480]
    assert slow["eval"][0]["stsb_dev_spearman"] == np.inf and slow["valid"][1]["flag"] is True
