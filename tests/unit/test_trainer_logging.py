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
