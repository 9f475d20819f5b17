"""Stop signals: SIGUSR1/SIGTERM (preemption) and a first SIGINT (Ctrl-C) ask the trainer to finish the step,
checkpoint and exit; a second SIGINT aborts at once. Once the trainer closes (or aborts), a further SIGINT no longer
raises: it abandons a save still in flight and the close goes on (``closing``), so the run directory's lock is
released, the loader's workers stopped and the exit code the one the run returned. DataLoader workers ignore all three
(``ignore_in_worker``): a signal sent to the whole process group must not kill the workers the checkpoint
still waits on — the main process decides."""

from __future__ import annotations

import os
import signal
import sys


class StopSignal:
    """Sets ``requested`` when SIGUSR1, SIGTERM or a first SIGINT arrives (handlers restored by ``uninstall``)."""

    SIGNALS = ("SIGUSR1", "SIGTERM", "SIGINT")

    def __init__(self, install: bool = True):
        self.requested = False
        self.received: str | None = None
        self._previous: dict = {}
        self._on_close_ctrl_c = None
        """Set by ``closing`` (and by the abort itself): what a SIGINT does instead of raising."""
        if install:
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT" and self._on_close_ctrl_c is not None:
            step = self._on_close_ctrl_c()
            what = f"the checkpoint of step {step} being written is abandoned; " if step is not None else ""
            _say(f"received SIGINT while stopping: {what}the run directory is released before the exit")
            return
        if name == "SIGINT" and self.received == "SIGINT":
            _say("received a second SIGINT: aborting now, without a checkpoint")
            self._on_close_ctrl_c = _nothing  # the abort itself closes: a third Ctrl-C must not cut that short
            raise KeyboardInterrupt
        self.requested = True
        self.received = self.received or name
        more = " (press Ctrl-C again to abort at once)" if name == "SIGINT" else ""
        _say(f"received {name}: will checkpoint after the current step{more}")

    @property
    def exit_code(self) -> int:
        """130 after Ctrl-C (the shell's convention: the user stopped it); 75 (EX_TEMPFAIL) after a
        preemption signal, which tells the launcher to requeue the job."""
        return 130 if self.received == "SIGINT" else 75

    def closing(self, on_ctrl_c) -> None:
        """The trainer closes: from now on a SIGINT calls ``on_ctrl_c()`` (which abandons a save in flight and
        returns its step, or None) and returns, where it would raise KeyboardInterrupt in the middle of the close
        (a second Ctrl-C after the stop's checkpoint: the run directory's lock was left behind, with a traceback and
        exit -2)."""
        self._on_close_ctrl_c = on_ctrl_c

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def _nothing() -> None:
    return None


def _say(line: str) -> None:
    """One line to stderr from a signal handler, written to its descriptor. A print would go through the stream's
    buffer, which the interrupted main thread may be inside (a print blocked on a full pipe to srun): Python then
    raises "reentrant call inside BufferedWriter" in the main thread, at that print. A stream without a descriptor
    (a test's capture) is printed to."""
    try:
        fd = sys.stderr.fileno()
    except (AttributeError, OSError, ValueError):
        print(line, file=sys.stderr, flush=True)
        return
    data = (line + "\n").encode(errors="replace")
    try:
        while data:
            data = data[os.write(fd, data):]
    except OSError:  # stderr closed or gone: the stop goes on without its message
        pass


def ignore_in_worker() -> None:
    """For DataLoader workers: ignore the stop signals (the main process handles them and shuts the workers
    down; a worker whose parent is gone exits by itself)."""
    for name in StopSignal.SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)
