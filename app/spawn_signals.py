"""SIGTERM to a ``ddp_spawn`` run's launching process is passed on to the ranks it spawned.

Under ``ddp_spawn`` the process a user (or ``docker stop``, SLURM, a ``kill``) signals is not a rank: it spawned the
ranks and waits for them. Python's default action ended it at once, and its ranks trained on, orphaned, to the end
of the run, with no checkpoint taken at the stop (seen: 30 epochs finished after the SIGTERM). Here the launching
process passes SIGTERM on to every rank, whose :class:`~app.callbacks.Preemption` finishes the step, writes
``last.ckpt`` and exits 143, and then exits 143 itself, without torch's traceback for a rank that exited non-zero.

SIGINT is left as it is: Ctrl-C in a terminal reaches every process of the foreground group, the ranks included, and
passing it on would make it a second signal (which stops at once, without a checkpoint).
"""

from __future__ import annotations

import logging
import signal
import sys
import threading

from app.lightning_internals import spawned_ranks_launcher

_received: list[int] = []  # the signals passed on in this process


def pass_sigterm_to_spawned_ranks(trainer) -> None:
    """Before ``trainer.fit`` (or validate, test, predict) in the launching process of a ``ddp_spawn`` run."""
    launcher = spawned_ranks_launcher(trainer.strategy)
    if launcher is None or threading.current_thread() is not threading.main_thread():
        return

    def forward(signum, frame) -> None:
        _received.append(signum)
        # torch's "Terminating process N via signal SIGTERM" when the first rank exits: the other one is exiting too
        logging.getLogger("torch.multiprocessing.spawn").addFilter(
            lambda record: "Terminating process" not in record.getMessage()
        )
        launcher.kill(signum)  # every rank still running: each finishes its step, saves and exits 143

    signal.signal(signal.SIGTERM, forward)


def stopped_exit_code(err: BaseException) -> int | None:
    """143 when ``err`` is torch's report that a spawned rank ended after a SIGTERM passed on here, else None. A rank
    that exited 143 said where it saved; one that the signal ended outside training (its interpreter's first seconds,
    before it could take the signal, or its last ones) wrote no checkpoint at the stop, which one line says."""
    if not _received or type(err).__name__ != "ProcessExitedException":  # torch.multiprocessing's
        return None
    code = 128 + signal.SIGTERM
    if getattr(err, "exit_code", None) == code:
        return code
    if getattr(err, "signal_name", None) == "SIGTERM":
        print(
            "SIGTERM: a ddp_spawn rank ended on it outside training (while starting, or finishing after its last "
            "checkpoint), so none was written at the stop; the checkpoints on disk are whole, as they were written",
            file=sys.stderr,
        )
        return code
    return None
