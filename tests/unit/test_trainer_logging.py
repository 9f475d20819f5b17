"""What the trainer tells the user while it runs."""

from __future__ import annotations


def test_data_starvation_warns_once(capsys):
    """The trainer warns once when the step waits for data more than 10% of the time (not in the first window)."""
    from types import SimpleNamespace

    from pretrain.training.trainer import DATA_WAIT_WARN, Trainer

    t = SimpleNamespace(step=10, _warned_starved=False,
                        cfg=SimpleNamespace(train=SimpleNamespace(log_every=10), data=SimpleNamespace(num_workers=1)))
    Trainer._warn_if_starved(t, 0.5)  # the first log window (worker start-up): no warning
    t.step = 20
    Trainer._warn_if_starved(t, DATA_WAIT_WARN / 2)
    assert "warning" not in capsys.readouterr().out
    Trainer._warn_if_starved(t, 0.42)
    t.step = 30
    Trainer._warn_if_starved(t, 0.9)
    out = capsys.readouterr().out
    assert out.count("warning: step 20 waited for data 42% of the time") == 1 and "step 30" not in out
    assert "data.num_workers (now 1)" in out


def test_console_line_shows_every_objective_figure_and_the_time_left():
    from pretrain.metrics.writer import format_duration, format_progress

    scalars = {"step": 40, "split": "train", "time": 1.0, "loss": 2.5, "info_nce": 2.25, "pos_cos": 0.8125,
               "neg_cos": 0.125, "acc": 0.75, "lr": 3e-5, "grad_norm": 1.5, "loss_scale": 1.0, "bad_steps": 0,
               "samples_per_s": 1234.4, "tokens_per_s": 45678.9, "tokens_seen": 99, "data_wait_frac": 0.034}
    line = format_progress(40, 100, scalars, eta_s=3725)
    assert line == ("step 40/100 | loss 2.5 | info_nce 2.25 | pos_cos 0.8125 | neg_cos 0.125 | acc 0.75 | lr 3e-05 | "
                    "grad_norm 1.5 | samples_per_s 1,234 | tokens_per_s 45,679 | data_wait 3.4% | eta 1h02m")
    assert "loss_scale 512" in format_progress(1, 2, {**scalars, "loss_scale": 512.0, "bad_steps": 1})
    assert (format_duration(95), format_duration(4), format_duration(-3)) == ("1m35s", "4s", "0s")
