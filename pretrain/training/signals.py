"""Preemption signals: SIGUSR1/SIGTERM ask the trainer to finish the step, checkpoint and exit."""

from __future__ import annotations

import signal
import sys


class StopSignal:
    """Sets ``requested`` when SIGUSR1 or SIGTERM arrives (handlers restored by ``uninstall``)."""

    SIGNALS = ("SIGUSR1", "SIGTERM")

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
        self.requested = True
        self.received = signal.Signals(signum).name
        print(f"received {self.received}: will checkpoint after the current step", file=sys.stderr, flush=True)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()
