"""A weeks-long run's history as the console, metrics.jsonl and ``pretrain-report`` show it: launches that resume
far from step 0 (their first step holds compilation and the loader's start-up), rollbacks, values no plot can draw,
run directories with odd names — each with small synthetic histories, the parts called directly."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import torch

from pretrain.training import progress

STARTUP_S, STEP_S = 60.0, 0.5
"""A resumed launch's first step (compilation, the loader's workers, the first batch) and every later step."""


class _Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch) -> _Clock:
    """progress.py's time.perf_counter, moved by the test."""
    c = _Clock()
    monkeypatch.setattr(progress, "time", SimpleNamespace(perf_counter=c))
    return c


def _env():
    return SimpleNamespace(rank=0, world_size=1, is_distributed=False, is_main=True)


def _run_steps(window, clock, steps, *, first_s=STEP_S, wait_first_s=0.0):
    """``steps`` optimizer steps into ``window`` (8 samples, 1000 tokens each): the first takes ``first_s`` (of it
    ``wait_first_s`` waiting for its batch), the others STEP_S."""
    for i in range(steps):
        clock.now += first_s if i == 0 else STEP_S
        window.data_wait_s += wait_first_s if i == 0 else 0.0
        window.add(8, 1000)
        window.sums.add("loss", torch.tensor(2.0, dtype=torch.float64), 1)


def test_a_resumed_launchs_first_record_rates_leave_out_its_start_up(clock):
    """A launch resumed at step 500,000 (and the stretch after a rollback: the loader starts afresh there too): its
    first step takes a minute, the window to the next record (10 steps) holds it. The record's samples/s and data
    wait are the steady ones: they were 1/13 of the throughput and a 60% wait, a dip in every throughput curve at
    each of a run's ~100 requeues (and the starvation warning)."""
    info = SimpleNamespace(lr=1e-3, grad_norm=1.0, loss_scale=1.0)
    window = progress.LogWindow()
    window.reset()
    window.resume({}, _env(), 1)
    _run_steps(window, clock, 1, first_s=STARTUP_S, wait_first_s=40.0)
    shown = window.scalars(_env(), info, bad_steps=progress.BadSteps(9, 0, None), tokens_seen=0)
    assert shown["samples_per_s"] == pytest.approx(8 / STARTUP_S)  # the launch's first line: that step, as it was
    _run_steps(window, clock, 9)
    out = window.scalars(_env(), info, bad_steps=progress.BadSteps(9, 0, None), tokens_seen=0)
    assert out["samples_per_s"] == pytest.approx(8 / STEP_S) and out["tokens_per_s"] == pytest.approx(1000 / STEP_S)
    assert out["data_wait_frac"] == 0.0 and out["loss"] == 2.0  # the figures still cover all 10 steps
    window.reset()  # the next window: all of it
    _run_steps(window, clock, 10)
    out = window.scalars(_env(), info, bad_steps=progress.BadSteps(9, 0, None), tokens_seen=0)
    assert out["samples_per_s"] == pytest.approx(8 / STEP_S)
    # log_every=1: a window of one step after a start has no other step to measure
    window.reset()
    window.resume({}, _env(), 1)
    _run_steps(window, clock, 1, first_s=STARTUP_S)
    out = window.scalars(_env(), info, bad_steps=progress.BadSteps(9, 0, None), tokens_seen=0)
    assert out["samples_per_s"] == pytest.approx(8 / STARTUP_S)


def test_the_time_left_leaves_out_the_start_up_and_a_rollbacks_own_time(clock):
    """ETA of a launch resumed at step 500,000 of 1,000,000 at 0.5 s a step: the first step's minute of start-up
    made it 13x too long at the next line (and still 12% at step +1000); the first line has no ETA (one step,
    start-up only: it said 347 days). After a rollback (here 100 steps back, 30 s to load the checkpoint), the
    steps since it are measured, with those before: the undone steps and the load were counted as progress."""
    eta = progress.Eta(500_000, 1_000_000)
    clock.now += STARTUP_S
    assert eta(500_001) is None
    clock.now += 9 * STEP_S
    assert eta(500_010) == pytest.approx((1_000_000 - 500_010) * STEP_S)
    clock.now += 90 * STEP_S
    assert eta(500_100) == pytest.approx((1_000_000 - 500_100) * STEP_S)
    clock.now += 30.0 + 10 * STEP_S  # rolled back to 500,000 (load 30 s), ran 10 steps
    assert eta(500_010) == pytest.approx((1_000_000 - 500_010) * STEP_S)
    clock.now += 10 * STEP_S
    assert eta(500_020) == pytest.approx((1_000_000 - 500_020) * STEP_S)
    # back before the launch's own start (an older checkpoint): still measured
    clock.now += 30.0 + 10 * STEP_S
    assert eta(499_010) == pytest.approx((1_000_000 - 499_010) * STEP_S)


def test_a_resumed_launchs_first_window_does_not_warn_of_starvation():
    """The first window of a launch holds its workers' start-up whatever step it resumed at; only a fresh run's
    (step <= log_every) was spared the warning, so each of ~100 requeues could warn wrongly."""
    watch = progress.StarvationWatch(log_every=10, num_workers=2)
    assert watch.update(500_010, 0.6) is None
    assert "waited for data 60%" in watch.update(500_020, 0.6)


# -- pretrain-report --------------------------------------------------------------------------------------------


def _run_dir(root, name: str, rows: list[dict]):
    run = root / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return run


def _train(steps, **figures) -> list[dict]:
    return [{"step": s, "split": "train", "time": 1.0 + s, "loss": 3.0, "grad_norm": 1.0, **figures} for s in steps]


def test_the_report_draws_what_it_can_and_says_what_it_could_not(tmp_path, capsys):
    """A grad norm of 1.7e308 made matplotlib fail ("arange: cannot compute length"): no report at all, exit 2.
    Values beyond float32 (inf in TensorBoard), NaN and inf are gaps in the curve, now named under the plot (a NaN
    loss among 1e5 points was an invisible one-point gap)."""
    from pretrain.report import main

    rows = _train(range(10, 110, 10))
    rows[3]["grad_norm"], rows[5]["grad_norm"], rows[7]["grad_norm"] = 1.7e308, "inf", 1e300
    rows[4]["loss"] = "nan"
    run = _run_dir(tmp_path, "run", rows)
    assert main([str(run), "--out", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    md = (tmp_path / "out" / "report.md").read_text(encoding="utf-8")
    assert (tmp_path / "out" / "grad_norm.png").is_file()
    assert "run: 3 value(s), the first at step 40" in md and "run: 1 value(s), the first at step 50" in md


@pytest.mark.parametrize("name", ["_baseline", "lr$\\eta$ x$\\foo$", "lauf-ä-日本"])
def test_odd_run_names_are_drawn_and_named_as_they_are(tmp_path, capsys, name):
    """A run directory named "_baseline" was left out of every legend (matplotlib drops labels starting with "_");
    one named "lr$\\eta$ x$\\foo$" stopped the report (mathtext: unknown symbol \\foo; exit 2) and "$\\eta$"
    showed as the letter eta."""
    import warnings

    from pretrain.report import PLOTS, load_run, main

    rows = _train(range(10, 60, 10)) + [{"step": 30, "split": "rollback", "trigger_step": 35, "retry": 1}]
    run = _run_dir(tmp_path, name, rows)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")  # (CJK glyphs missing from the default font are only warned of)
        assert main([str(run), "--out", str(tmp_path / "out")]) == 0, capsys.readouterr().err
    assert not [w for w in seen if "No artists with labels" in str(w.message)]
    from pretrain.report import figure as report_figure

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        fig, _, _ = report_figure(PLOTS[0], [load_run(run, name)])
        fig.canvas.draw()
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert legend[0] == name.replace("$", "\\$") and legend[1].endswith(": rollback")
    assert f"**{name}**" in (tmp_path / "out" / "report.md").read_text(encoding="utf-8")


def test_a_run_without_checkpoints_yet_is_said_to_have_none(tmp_path, capsys):
    """Before its first checkpoint a run directory was described as unrecognised weights ("run (unrecognised)")."""
    from pretrain.report import main

    run = _run_dir(tmp_path, "run", _train(range(10, 40, 10)))
    assert main([str(run), "--out", str(tmp_path / "out")]) == 0
    assert f"{run}: no checkpoint yet" in capsys.readouterr().out


def test_a_long_history_is_read_a_line_at_a_time_with_one_copy_of_each_key(tmp_path):
    """The reader held the whole file and its lines besides the records, and each record its own copy of every
    key: +300 MB to read a 1e6-step run's 1e5 records (41 MB), now +100 MB. A cut last line, a NaN and a metric
    that appears only late are read as before."""
    from pretrain.report import read_metrics

    rows = _train(range(10, 1010, 10)) + _train(range(1010, 2010, 10), info_nce=1.5)
    rows[7]["loss"] = "nan"
    path = _run_dir(tmp_path, "run", rows) / "metrics.jsonl"
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"step": 2010, "split": "tra')
    records, notes = read_metrics(path)
    train = records["train"]
    assert [r["step"] for r in train] == list(range(10, 2010, 10)) and math.isnan(train[7]["loss"])
    assert "info_nce" not in train[99] and train[100]["info_nce"] == 1.5
    assert any("last line is incomplete" in n for n in notes)
    first, last = list(train[0]), list(train[-1])
    assert all(a is b for a, b in zip(first, last))
