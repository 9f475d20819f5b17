"""distributed/signals.py: which Ctrl-C raises. The first asks for a checkpoint, the second aborts (raises once);
after that, and while the trainer closes, a Ctrl-C calls the close's callback and never raises."""

from __future__ import annotations

import os
import signal

import pytest

from pretrain.distributed.signals import StopSignal


@pytest.fixture
def stop():
    s = StopSignal()
    yield s
    s.uninstall()


def _ctrl_c() -> None:
    os.kill(os.getpid(), signal.SIGINT)  # the handler runs in this (the main) thread before kill returns


def test_the_second_ctrl_c_aborts_once_and_later_ones_do_not_cut_the_abort_short(stop, capsys):
    _ctrl_c()
    assert stop.requested and stop.received == "SIGINT" and stop.exit_code == 130
    with pytest.raises(KeyboardInterrupt):
        _ctrl_c()
    _ctrl_c()  # a third one, while the abort closes: no exception
    err = capsys.readouterr().err
    assert "received a second SIGINT: aborting now" in err
    assert "received SIGINT while stopping: the run directory is released before the exit" in err


def test_while_closing_a_ctrl_c_calls_back_and_names_the_abandoned_save(stop, capsys):
    calls = []
    stop.closing(lambda: calls.append(1) or 7)
    _ctrl_c()  # even a first one: the run is over
    _ctrl_c()
    assert calls == [1, 1]
    err = capsys.readouterr().err
    assert err.count("the checkpoint of step 7 being written is abandoned; the run directory is released") == 2


def test_uninstall_restores_the_previous_handlers():
    before = signal.getsignal(signal.SIGINT)
    s = StopSignal()
    assert signal.getsignal(signal.SIGINT) != before
    s.uninstall()
    assert signal.getsignal(signal.SIGINT) == before
