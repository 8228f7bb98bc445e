"""SIGINT and SIGTERM for ``spin-cluster serve``, in every state of its life.

    starting, deploying   the signal raises ``Interrupted`` in the main thread: Ray's start-up
                          and ``serve.run``'s wait for the app are Python loops, so it unwinds
                          them at once into local mode's ``finally`` (which stops the cluster)
    serving               the signal is recorded; local mode's wait sees it and stops in order
                          (on SIGTERM: a drain first, see ``local.py``)

A stop that has not ended the process by its deadline (``STOP_WITHIN_S``, plus the drain when
there is one) ends it from a watchdog thread: a stuck call into Ray must not keep a process
that was told to stop, which on Kubernetes the kubelet would kill with nothing logged. The
Ray services this process started share its fate (Ray starts them with a parent-death
signal), and their workers exit when the raylet goes.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from typing import Any

# From the signal to the end of the process: what an operator (and a pod's kubelet) waits.
STOP_WITHIN_S = 5.0
# The watchdog's own deadline, inside STOP_WITHIN_S: what the process's exit takes after it.
_WATCHDOG_S = STOP_WITHIN_S - 0.5
SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(BaseException):
    """A signal before the app serves; a BaseException so that no ``except Exception`` of
    Ray's or ours swallows it on the way out."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class ServeSignals:
    """Handlers for SIGINT and SIGTERM from ``install`` to ``restore``; ``serving`` switches
    them from interrupting to recording."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.hurry = threading.Event()  # a second signal: end a drain now
        self.signum: int | None = None
        self._deadline = float("inf")
        self._serving = False
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        """Again after ``ray.init``, which sets a SIGTERM handler of its own."""
        for sig in SIGNALS:
            previous = signal.signal(sig, self._on_signal)
            self._previous.setdefault(sig, previous)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def serving(self) -> None:
        self._serving = True
        if self.signum is not None:  # a signal came as the app became ready
            self.stop.set()

    def extend(self, seconds: float) -> None:
        """Pushes the watchdog's deadline ``seconds`` further: a drain's grace period."""
        self._deadline += seconds

    def _on_signal(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            self.hurry.set()
            return
        self.signum = signum
        self._start_watchdog()
        if not self._serving:
            raise Interrupted(signum)
        self.stop.set()

    def _start_watchdog(self) -> None:
        self._deadline = time.monotonic() + _WATCHDOG_S
        threading.Thread(target=self._watch, name="stop-watchdog", daemon=True).start()

    def _watch(self) -> None:
        while time.monotonic() < self._deadline:
            time.sleep(0.05)
        print("stop: the stop outlasted its deadline; exiting now", file=sys.stderr, flush=True)
        os._exit(128 + (self.signum or signal.SIGTERM))
