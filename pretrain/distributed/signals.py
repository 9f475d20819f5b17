"""Stop signals: SIGUSR1/SIGTERM (preemption) and a first SIGINT (Ctrl-C) ask the trainer to finish the step,
checkpoint and exit; a second SIGINT aborts at once. DataLoader workers ignore all three
(``ignore_in_worker``): a signal sent to the whole process group must not kill the workers the checkpoint
still waits on — the main process decides."""

from __future__ import annotations

import signal
import sys


class StopSignal:
    """Sets ``requested`` when SIGUSR1, SIGTERM or a first SIGINT arrives (handlers restored by ``uninstall``)."""

    SIGNALS = ("SIGUSR1", "SIGTERM", "SIGINT")

    def __init__(self, install: bool = True):
        self.requested = False
        self.received: str | None = None
        self._previous: dict = {}
        if install:
            for name in self.SIGNALS:
                sig = getattr(signal, name, None)
                if sig is not None:
                    self._previous[sig] = signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        name = signal.Signals(signum).name
        if name == "SIGINT" and self.received == "SIGINT":
            print("received a second SIGINT: aborting now, without a checkpoint", file=sys.stderr, flush=True)
            raise KeyboardInterrupt
        self.requested = True
        self.received = self.received or name
        more = " (press Ctrl-C again to abort at once)" if name == "SIGINT" else ""
        print(f"received {name}: will checkpoint after the current step{more}", file=sys.stderr, flush=True)

    @property
    def exit_code(self) -> int:
        """130 after Ctrl-C (the shell's convention: the user stopped it); 75 (EX_TEMPFAIL) after a
        preemption signal, which tells the launcher to requeue the job."""
        return 130 if self.received == "SIGINT" else 75

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


def ignore_in_worker() -> None:
    """For DataLoader workers: ignore the stop signals (the main process handles them and shuts the workers
    down; a worker whose parent is gone exits by itself)."""
    for name in StopSignal.SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.SIG_IGN)
