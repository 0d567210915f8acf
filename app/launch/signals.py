"""Stop signals across processes, in one place: a launching process passes them on to its ranks, and a rank that is
still starting keeps them for :class:`~app.callbacks.Preemption`.

- ``ddp_spawn``: :func:`pass_sigterm_to_spawned_ranks` and :func:`stopped_exit_code`, below.
- The horovod strategy's self-launch under ``mpirun`` (app/strategies/launchers/mpirun.py): :class:`StopSignals` notes
  SIGTERM/SIGINT for the whole launch and passes them on to the ranks as they appear.
- A rank started by a launcher: :func:`~app.launch.early_signals.catch_early_signals` from its first line, and
  :func:`~app.launch.early_signals.take_early_signals` when
  Preemption installs its handlers.
- :func:`process_alive`: whether a rank (or the launcher) still runs; :func:`pid_namespace`, where its pid means it.
- :func:`exit_taken_over` / :func:`wait_for_taken_over_exit`: a thread that ends the process itself (the rank
  watchdog's, after a lost rank) and the main thread that must not leave before it (an MPI rank's exit would run
  MPI_Finalize, which waits for the lost rank for good).

``ddp_spawn``'s launching process. Under ``ddp_spawn`` the process a user (or ``docker stop``, SLURM, a ``kill``)
signals is not a rank: it spawned the ranks and waits for them. Python's default action ended it at once, and its
ranks trained on, orphaned, to the end of the run, with no checkpoint taken at the stop (seen: 30 epochs finished
after the SIGTERM). Here the launching process passes SIGTERM on to every rank, whose
:class:`~app.callbacks.Preemption` finishes the step, writes ``last.ckpt`` and exits 143, and then exits 143
itself, without torch's traceback for a rank that exited non-zero.

SIGINT is left as it is: Ctrl-C in a terminal reaches every process of the foreground group, the ranks included, and
passing it on would make it a second signal (which stops at once, without a checkpoint).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable

from app.launch.launcher import proc_stat
from app.lightning_internals import spawned_ranks_launcher

# ------------------------------------------------------------------------------------------------ ddp_spawn's launcher
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


# ------------------------------------------------------------------------------------------------ mpirun's ranks


OUTLIVE = 30.0  # seconds an mpirun may run on after its last rank exited (it normally exits within one)
HUNG = 124  # the exit code of an mpirun ended for outliving its ranks (timeout(1)'s code for "ended by us")


class StopSignals:
    """SIGTERM/SIGINT to the launching process, noted for the whole launch (each mpirun, and the time before and
    between them) and passed on to the ranks by :meth:`run`, also to ranks that write their pid only after the signal
    came: a rank takes seconds to start, and a signal sent to it before it has a handler would be lost."""

    def __init__(self) -> None:
        self.received: list[int] = []
        self._sent: set[tuple[int, int]] = set()  # (rank pid, index into received) already delivered
        self._previous: dict = {}

    def __enter__(self) -> StopSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._note) for s in (signal.SIGTERM, signal.SIGINT)}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)

    def _note(self, signum, frame) -> None:  # only noted here: run() sends, so no signal goes out twice
        self.received.append(signum)

    def _forward(self, pids: Callable[[], Iterable[int]]) -> None:
        for pid in pids() if self.received else ():
            for index, signum in enumerate(self.received):
                if (pid, index) not in self._sent:
                    with contextlib.suppress(OSError):  # a rank that has just exited
                        os.kill(pid, signum)
                        self._sent.add((pid, index))

    def run(
        self,
        cmd: list[str],
        env: dict,
        pids: Callable[[], Iterable[int]],
        cleanup: Callable[[], None],
        ranks_running: Callable[[], bool] | None = None,
        outlive: float = OUTLIVE,
        started: Callable[[int], None] | None = None,
    ) -> tuple[int, int]:
        """Run ``cmd`` (mpirun), passing signals on to the processes ``pids()`` names (its ranks, which appear one by
        one), then ``cleanup()``. Returns (exit code, the first signal received or 0). ``started(pid)`` is told the
        pid of ``cmd`` as soon as it runs (for the launch's reaper, which stops it should this process die).

        An mpirun that outlives all its ranks by ``outlive`` seconds (``ranks_running()`` was true, then stayed
        false) is hung: seen with Open MPI 5, whose prterun printed "Abort is in progress...hit ctrl-c again" after
        a rank was lost in a save, and waited for good. It is killed with its session, and the launch fails
        (:data:`HUNG`), so that the launcher restarts the ranks or says why not."""
        process = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, start_new_session=True)
        if started is not None:
            started(process.pid)
        seen, gone_since, looked = False, None, 0.0
        try:
            while True:
                try:
                    returncode = process.wait(timeout=0.2)
                    break
                except subprocess.TimeoutExpired:
                    self._forward(pids)
                if ranks_running is None or time.monotonic() - looked < 1.0:  # a look reads /proc: once a second
                    continue
                looked = time.monotonic()
                if ranks_running():
                    seen, gone_since = True, None
                elif seen:
                    gone_since = gone_since or time.monotonic()
                    if time.monotonic() - gone_since >= outlive and process.poll() is None:
                        name = os.path.basename(cmd[0])
                        print(
                            f"error: {name} (pid {process.pid}) outlived all its ranks by {outlive:g} s (hung in its "
                            "own shutdown): ended, and this launch counts as failed",
                            file=sys.stderr,
                            flush=True,
                        )
                        with contextlib.suppress(OSError):
                            os.killpg(process.pid, signal.SIGKILL)  # its session: prterun and any daemon it forked
                        process.wait()
                        returncode = HUNG
                        break
        finally:
            if process.poll() is None:
                process.kill()
            cleanup()
        return returncode, (self.received[0] if self.received else 0)


def pid_namespace() -> str:
    """This process's pid namespace: a pid read from a peer on the same host names a process here only where the two
    share it (two containers on one host, each a node with the host's name and network, do not)."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "?"


def process_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie, exited but not yet reaped by its parent, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    fields = proc_stat(pid)
    return not fields or fields[0] != "Z"  # unreadable: os.kill found it, so it runs


# ------------------------------------------------------------------------------------------------ a thread's own exit
_exit_deadline: list[float] = []  # when the thread that took over this process's exit will have ended it


def exit_taken_over(within_s: float) -> None:
    """Called by a thread that will end this process itself (``os._exit``, once its save and its line are done),
    within ``within_s`` seconds."""
    _exit_deadline[:] = [time.monotonic() + within_s]


def wait_for_taken_over_exit() -> None:
    """Block while a thread that took over this process's exit (:func:`exit_taken_over`) is ending it, until its
    deadline. An MPI rank whose run failed calls it before it leaves: its own way out runs MPI_Finalize (mpi4py calls
    it at exit), which waits for a lost rank for good, and once the interpreter is finalizing, the other thread can no
    longer run to end the process (seen under load: the survivor of a lost rank 0 hung until the test's timeout)."""
    while _exit_deadline and time.monotonic() < _exit_deadline[0]:
        time.sleep(0.1)
