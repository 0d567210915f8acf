"""Cleans up after a horovod self-launch whose launcher is gone (run as a script, not for direct use).

:class:`app.strategies.launchers.mpirun.MPIRunLauncher` starts this next to mpirun, in a session of its own, with a pipe
on its standard input that only the launcher holds. The pipe reaches end-of-file when the launcher exits, however it
exits (SIGKILL included). A launcher that finished has removed its launch folder already, and this does nothing.
Otherwise this sends mpirun (its pid in the folder's ``mpirun.pid``) SIGTERM, which it passes to the ranks, which stop
with a checkpoint: this waits for them (up to ``GRACE`` seconds), SIGKILLs any left (a rank stopped with SIGSTOP
ignores SIGTERM), and removes the folder, which holds the pickled job. (It was the kernel's ``PR_SET_PDEATHSIG``, set
with ctypes in a ``preexec_fn`` while the launcher's threads ran, which Python's documentation calls unsafe; and the
kernel sends it when the thread that started mpirun ends, not the process.) It imports nothing of the template (no
torch): it sleeps for the whole run.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import time
from pathlib import Path

GRACE = 60.0  # seconds the ranks get to stop with their checkpoint after the launcher died
MPIRUN_PID = "mpirun.pid"  # in the launch folder: the launcher's mpirun of the moment
WORKER = b"app.strategies.launchers._mpi_worker"  # the rank program's module, in each rank's command line


def alive(pid: int) -> bool:
    """Whether ``pid`` runs the template's rank program (a pid reused since by another process does not count)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if WORKER not in f.read():
                return False
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def rank_pids(folder: Path) -> list[int]:
    """The ranks of the launch in ``folder`` that still run (their pids are in its ``rank-*.pid`` files)."""
    pids = []
    for pid_file in folder.glob("rank-*.pid"):
        try:
            pid = int(pid_file.read_text())
        except (OSError, ValueError):
            continue
        if alive(pid):
            pids.append(pid)
    return pids


def launch_running(folder: Path) -> bool:
    """Whether any rank of the launch in ``folder`` runs, whether or not it has written its pid yet: a Python running
    the rank program (``python -m app.strategies.launchers._mpi_worker JOB RESULT``) on the launch's job file, which
    lies in ``folder``. (mpirun's own command line holds the same words, after its options.)"""
    job = str(folder / "job.pkl").encode()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                args = f.read().split(b"\0")
        except OSError:
            continue
        if args[1:4] == [b"-m", WORKER, job] and alive(int(entry)):
            return True
    return False


def kill_ranks(folder: Path, wait: float = 30.0) -> None:
    """SIGKILL the ranks of ``folder`` that still run, and return once they are gone (up to ``wait`` seconds): a
    SIGKILL takes effect when the process next runs, so one in the middle of a rename or a write was still finishing
    it after ``kill`` returned, and a caller that then reads what the ranks wrote could read it too early."""
    pids = rank_pids(folder)
    for pid in pids:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + wait
    while any(map(running, pids)) and time.monotonic() < deadline:
        time.sleep(0.01)


def running(pid: int) -> bool:
    """Whether any thread of process ``pid`` has yet to exit (a zombie has, all of its threads)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] not in "ZX":
                    return True
        except (OSError, IndexError):
            continue  # that thread is gone
    return False


def stop_mpirun(folder: Path) -> None:
    """SIGTERM to the launch's mpirun, which passes it on to the ranks; nothing where it has gone (or its pid now
    names another process: mpirun's command line holds the launch's job file)."""
    try:
        pid = int((folder / MPIRUN_PID).read_text())
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if str(folder / "job.pkl").encode() in f.read():
                os.kill(pid, signal.SIGTERM)
    except (OSError, ValueError):
        pass


def main(folder: Path, grace: float = GRACE) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the launcher
    sys.stdin.buffer.read()  # until the launcher exits
    if not folder.exists():
        return  # it finished and cleaned up
    stop_mpirun(folder)
    deadline = time.monotonic() + grace
    while rank_pids(folder) and time.monotonic() < deadline:
        time.sleep(0.5)
    kill_ranks(folder)
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main(Path(sys.argv[1]), *map(float, sys.argv[2:3]))
