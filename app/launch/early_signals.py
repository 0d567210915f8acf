"""Stop signals that come while a process still starts, before :class:`~app.callbacks.Preemption` installs its
handlers: remembered instead of ending the process, and acted on once training runs. Imports nothing heavy, so that
a program can catch them from its first lines (``import lightning`` alone takes seconds).
"""

from __future__ import annotations

import signal
import time

# caught by catch_early_signals before a Preemption callback was installed: (signal number, time.monotonic() then)
_early_signals: list[tuple[int, float]] = []


def catch_early_signals(signals=(signal.SIGTERM, signal.SIGINT)) -> None:
    """Remember a stop signal that comes before the trainer runs, instead of dying of it: the horovod self-launch's
    ranks spend seconds importing and unpickling the job before Preemption installs its handlers, and the launcher
    forwards a SIGTERM/SIGINT as soon as a rank has written its pid. Preemption acts on it once installed."""
    for signum in signals:
        signal.signal(signum, lambda signum, frame: _early_signals.append((signum, time.monotonic())))


def take_early_signals(signals) -> list[tuple[int, float]]:
    """The stop signals among ``signals`` caught so far by :func:`catch_early_signals`, each with the
    ``time.monotonic()`` it came at, forgotten once taken."""
    early = [(signum, at) for signum, at in _early_signals if signum in signals]
    _early_signals.clear()
    return early
