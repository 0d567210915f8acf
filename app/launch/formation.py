"""A rank that fails before the process group forms stops the others in seconds, not after torch's 30 minutes.

The group forms in ``init_process_group``, at a ``TCPStore`` at ``MASTER_ADDR:MASTER_PORT`` (rank 0's, or torchrun's
agent's). A rank that fails before it arrives (a flag wrong on its node, a missing file, a GPU that does not start)
never comes, and the others waited for torch's 30 minutes without a word; nothing told the other nodes (mpirun ends
every rank itself). So:

- a rank that exits with an error before the group formed leaves a mark in that store: who it was and the line that
  says why (:func:`announce_failure`, called by ``cli.py``'s ``main`` and by an uncaught exception). Rank 0, whose
  store does not exist yet, hosts one itself for up to :data:`HOLD` seconds, until every other rank has read it;
  another rank waits up to :data:`POST_WAIT` seconds for rank 0's store to open;
- every rank, while its group forms (:class:`FormationWatch`, started by ``formation_watched`` in the template's
  ddp, fsdp and pipeline strategies), reads the store every second. On a mark it says in one line which rank
  failed and why, and exits with code 1: the main thread is blocked inside ``init_process_group``, where nothing
  can be raised into it.

A rank that is killed while its group forms (SIGKILL, the out-of-memory killer, its machine lost) leaves no mark:

- every watching rank adds to a count of its own in the store each second (:data:`BEAT`), and rank 0's watch
  leaves the mark for a rank whose count stopped: at once where its process, on rank 0's host, is gone; else after
  the rank watchdog's timeout (``--watchdog.timeout``, :data:`LOST_AFTER` without one). A rank not yet arrived is
  not judged: it may be slow to start;
- rank 0 hosts the store, which ends with it: a waiting rank's ``init_process_group`` then fails at once, and it
  says so in one line (:func:`app.strategies.ddp.formation_watched`), not torch's 60.

Under torchrun, while the agents will restart the round, a failed worker leaves no mark and rank 0 judges no
silence; a mark older than this process (the agent's store outlives a round) is not read. Once formed,
:class:`~app.callbacks.RankWatchdog` takes over.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterable
from datetime import timedelta
from typing import NoReturn

from app.launch.host_address import resolves
from app.launch.launcher import expected_ranks, is_first_process, launcher_ranks, slurm_job, this_rank, torchrun_job

MARK = "template/formation/failed"  # the first failure's JSON: rank, host, why, time
ANSWERED = "template/formation/answered"  # ranks that read the mark or left their own: rank 0's host stops at all
WORLD = "template/formation/world"  # the ranks of the run, as a watching rank knows it (a failed rank 0 may not)
BEAT = "template/formation/beat/"  # + a rank: the count that rank's watch adds to each poll while its group forms
WHO = "template/formation/who/"  # + a rank: "host:pid" of that rank, set as its watch starts
FORMED = "template/formation/formed/"  # + a rank: set once its group formed (its count stops: not a lost rank)
LOST_AFTER = 15.0  # seconds a rank's count may stand still before rank 0 takes it for lost (the RankWatchdog's timeout)
POLL = 1.0  # seconds between a watching rank's reads of the store
POST_WAIT = 15.0  # seconds a failed rank waits for rank 0's store to open (rank 0 may still be importing)
HOLD = 15.0  # seconds at most that a failed rank 0 keeps its store open for the others to read the mark
NOTICE_AFTER = 3.0  # seconds of that wait after which the failed rank says what it waits for
EXIT_CODE = 1
STALE_SLACK = 2.0  # seconds of clock difference between nodes that a mark of this round may show
UNREACHED_NOTICE = 30.0  # seconds without the group's store after which a waiting rank says what it waits for
STALL_MEMORY = 60.0  # seconds a watch remembers that its process did not run for a while (stopped, then woken)

_formed = False  # this process's group has formed: a failure after it is the RankWatchdog's
_announced = False  # this process has left its mark (cli.py's main, then the exception hook: once)
WHY_LENGTH = 300  # characters of the failed rank's line that the others repeat
_before_stopping: list[Callable[[], None]] = []  # run before a peer's failure ends this process


def before_stopping(cleanup: Callable[[], None]) -> None:
    """Have ``cleanup()`` run before a peer's failure ends this process (which raises nothing: it ends from the watch's
    thread), as it would run on an error: the run folder ``cli.py`` claimed, still empty, is released."""
    _before_stopping.append(cleanup)


def formed() -> None:
    """Called once this process's group has formed: a later failure leaves no mark."""
    global _formed
    _formed = True


def store_address() -> tuple[str, int] | None:
    """Where the process group forms, read before any strategy exists: ``(MASTER_ADDR, MASTER_PORT)`` of a run of
    several processes that no MPI launcher started, or None (one process, or mpirun, which ends every rank itself)."""
    if launcher_ranks() is not None:
        return None
    env = os.environ
    job = slurm_job()
    if torchrun_job() is None and job is not None and job.in_step and job.tasks > 1:
        from lightning.fabric.plugins.environments import SLURMEnvironment

        try:  # the first node of the job, the port from the job id, or MASTER_ADDR / MASTER_PORT where set
            slurm = SLURMEnvironment()
            return slurm.main_address, slurm.main_port
        except (KeyError, ValueError, IndexError):
            return None
    several = torchrun_job() is not None or int(env.get("WORLD_SIZE") or 1) > 1
    several = several or any(env.get(var) for var in ("NODE_RANK", "LOCAL_RANK", "RANK"))
    if not several or not env.get("MASTER_ADDR") or not env.get("MASTER_PORT", "").isdigit():
        return None
    return env["MASTER_ADDR"], int(env["MASTER_PORT"])


def process_start_time() -> float:
    """When this process started, in seconds since the epoch (``/proc``); now where that cannot be read."""
    try:
        with open("/proc/self/stat") as stat:
            ticks = int(stat.read().rpartition(")")[2].split()[19])
        with open("/proc/stat") as boot:
            booted = next(int(line.split()[1]) for line in boot if line.startswith("btime "))
        return booted + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def client(address: str, port: int, timeout: float):
    """A client of the store at ``address:port``, or None when none answers within ``timeout`` seconds."""
    import torch.distributed as dist

    from app.launch.library_noise import store_warnings_off

    try:
        with store_warnings_off(errors_too=True):  # "timed out while trying to connect": rank 0 is not up yet
            return dist.TCPStore(
                address, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False
            )
    except (RuntimeError, ValueError, OSError):
        return None


def announce_failure(why: str) -> None:
    """Leave the mark of this rank's failure where its group forms, so that the other ranks stop instead of waiting
    for it; nothing where there is no group to form, where it formed already, or where a launcher will restart this
    rank. Never raises: the rank is failing already, and says why itself."""
    global _announced
    if _announced:
        return
    _announced = True
    try:
        import torch.distributed as dist

        if _formed or (dist.is_available() and dist.is_initialized()):
            return
        address, job = store_address(), torchrun_job()
        if address is None or (job is not None and job.restarts_left) or not resolves(address[0]):
            return  # (no rank can reach a store at an address that does not resolve)
        mark = {"rank": this_rank(), "host": socket.gethostname(), "why": why[:WHY_LENGTH], "time": time.time()}
        # rank 0 hosts the store (torchrun's agent may host its own); where its port is taken, one is open already
        if not (is_first_process() and rank_zero_hosts_store() and _host_mark(*address, json.dumps(mark))):
            _post_mark(*address, json.dumps(mark))
    except (Exception, KeyboardInterrupt):  # noqa: BLE001 (a courtesy to the others: this rank's own error is what matters)
        return


def _post_mark(address: str, port: int, mark: str) -> None:
    wait = _Wait(POST_WAIT, f"for the store at {address}:{port} (rank 0's) to open")
    while wait.on():
        store = client(address, port, timeout=min(2.0, wait.left()))
        if store is not None:
            store.compare_set(MARK, "", mark)  # the first failure's mark stays: it is the cause
            store.add(ANSWERED, 1)
            return


def rank_zero_hosts_store() -> bool:
    """Rank 0's process hosts the store the group forms at: everywhere but under torchrun's shared agent store."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True"


def _host_mark(address: str, port: int, mark: str) -> bool:
    """Rank 0, failed before it opened the store: open it with the mark in it and keep it open until every other rank
    has read it (or left its own mark), at most :data:`HOLD` seconds. False when the port is taken."""
    import torch.distributed as dist

    from app.launch.library_noise import store_warnings_off

    try:
        with store_warnings_off():
            store = dist.TCPStore(address, port, is_master=True, timeout=timedelta(seconds=5), wait_for_workers=False)
    except (RuntimeError, ValueError, OSError):
        return False
    store.set(MARK, mark)
    world = expected_ranks()  # or, where the launcher does not say (nodes started by hand), the first reader's
    wait = _Wait(HOLD, "for the other ranks to read it")
    while wait.on():
        if world is None and store.check([WORLD]):
            world = int(store.get(WORLD))
        if world is not None and store.add(ANSWERED, 0) >= world - 1:
            break
        time.sleep(0.2)
    return True


class _Wait:
    """A bounded wait to tell the others of a failure; after :data:`NOTICE_AFTER` s it says once what it waits for."""

    def __init__(self, seconds: float, what: str, quiet: bool = False, skip: str = "; Ctrl-C skips it") -> None:
        self.start, self.seconds, self.what, self.said, self.skip = time.monotonic(), seconds, what, quiet, skip

    def left(self) -> float:
        return max(self.start + self.seconds - time.monotonic(), 0.1)

    def on(self) -> bool:
        elapsed = time.monotonic() - self.start
        if elapsed >= NOTICE_AFTER and not self.said:
            self.said = True
            say(
                f"(telling the other ranks of the failure, so that they do not wait for the failed rank: waiting up to "
                f"{self.seconds - elapsed:.0f} s more {self.what}{self.skip})"
            )
        return elapsed < self.seconds


def peer_failed_line(mark: dict) -> str:
    where = f" on {mark['host']}" if mark.get("host") else ""
    return (
        f"error: {mark.get('rank', 'a rank')}{where} failed before the process group formed "
        f"({mark.get('why') or 'see its output'}); this rank stops too, instead of waiting for it "
        "(torch's timeout is 30 minutes)"
    )


def store_lost_line(address: str, port: int, err: BaseException, stalled: float = 0.0) -> str:
    """What a waiting rank says when the store its group forms at closed under it: its host, rank 0 (or, under
    torchrun, node 0's agent), stopped without a word (killed, out of memory, its machine lost); or, ``stalled``
    seconds after this rank was stopped (SIGSTOP, a frozen machine), rank 0 took this rank for lost and left."""
    if stalled:
        return (
            f"error: this rank was stopped or frozen for {stalled:.0f} s before the process group formed, and the "
            f"store at {address}:{port} where the group forms is gone: rank 0 took this rank for lost and stopped "
            "(see its output); start the run again"
        )
    host = "node 0's torchrun agent" if not rank_zero_hosts_store() else "rank 0"
    detail = next(iter(str(err).splitlines()), type(err).__name__)
    return (
        f"error: {host} stopped before the process group formed: the store it hosts at {address}:{port}, where the "
        f"group forms, closed ({detail}); this rank stops too (killed, out of memory, or its machine lost? see "
        f"{host}'s output)"
    )


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def stop_process(line: str | None, cleanups: Iterable[Callable[[], object]] | None = None) -> NoReturn:
    """Say ``line`` (where given), run ``cleanups`` (by default the :func:`before_stopping` ones: what the process
    would do on its way out) and end the process with exit code 1, from any thread.

    The one forced exit outside a launcher's child: its callers (this watch, the rank watchdog) are helper threads
    whose main thread may be blocked in ``init_process_group`` or a gloo collective, which nothing unblocks.
    """
    if line:
        say(line)
    for cleanup in _before_stopping if cleanups is None else cleanups:
        with contextlib.suppress(Exception):  # the line is said: the rest is tidying up
            cleanup()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(EXIT_CODE)


class FormationWatch(threading.Thread):
    """Reads the store at ``address:port`` every :data:`POLL` seconds while the group forms; on a failed rank's mark
    calls ``on_failure(mark)`` (default: say it, when ``say``, and end the process). :meth:`stop` once formed.

    ``rank``: this process's global rank, which adds to its count (:data:`BEAT`) at each poll; rank 0 judges the
    others' counts (the module's docstring) and leaves the mark of a rank silent for ``lost_after`` seconds.
    ``world_size``: the ranks of the run;
    ``hosts_store``: this process hosts the store (rank 0, not under torchrun's agent store). The host's process keeps
    the store, which ends with it, open until every rank has read the mark or left its own (at most :data:`HOLD`
    seconds): a rank that had not read it yet would otherwise wait for good."""

    def __init__(
        self,
        address: str,
        port: int,
        world_size: int = 0,
        hosts_store: bool = False,
        say: bool = True,
        on_failure: Callable | None = None,
        rank: int | None = None,
        lost_after: float = LOST_AFTER,
    ) -> None:
        super().__init__(name="formation-watch", daemon=True)
        self.address, self.port = address, port
        self.world_size, self.hosts_store, self.rank, self.lost_after = world_size, hosts_store, rank, lost_after
        self.say, self._said, self._default = say, False, on_failure is None
        self.on_failure = on_failure or (lambda mark: self._tell(mark) or stop_process(None))
        job = torchrun_job()
        # torchrun's agent keeps its store across restarts: an earlier round's mark is older than this process
        self.since = process_start_time() - STALE_SLACK if job is not None else float("-inf")
        # rank 0 judges the others' silence; not where torchrun's agents will restart the round
        self.judge = rank == 0 and world_size > 1 and not (job is not None and job.restarts_left)
        self.mark_seen = threading.Event()  # a mark was read: the process ends from this thread
        self.last_poll = time.monotonic()  # when this thread last ran: long ago in a process that was stopped
        # the longest this thread did not run in the last STALL_MEMORY seconds: a process stopped and woken
        self.stalled, self.stalled_at = 0.0, self.last_poll
        self._counts: dict[int, tuple[int, float]] = {}  # rank: (its count, when it was first read so)
        self._who: dict[int, tuple[str, int]] = {}  # rank: (host, pid)
        self._halt = threading.Event()

    def stop(self) -> None:
        self._halt.set()

    def run(self) -> None:
        from app.launch.library_noise import store_warnings_off

        store, started, waited_silently = None, time.monotonic(), True  # (no store reached yet, nothing said)
        while not self._halt.is_set():
            now = time.monotonic()
            gap, self.last_poll = now - self.last_poll, now
            if gap >= self.stalled or now - self.stalled_at > STALL_MEMORY:
                self.stalled, self.stalled_at = gap, now
            if store is None:
                store = self._connect()
                if store is None and waited_silently and (waited := time.monotonic() - started) >= UNREACHED_NOTICE:
                    waited_silently = False  # (measured after the try)
                    self._say_unreached(waited)
                if store is None:
                    self._halt.wait(POLL / 2)
                waited_silently = waited_silently and store is None
                continue
            try:
                with store_warnings_off():  # a store that closed (a failed rank 0's, when its hold ends)
                    mark = self._poll(store)
            except (RuntimeError, ValueError, OSError):
                store = None
                continue
            if mark is not None and not self._halt.is_set():
                self.on_failure(mark)
                return
            self._halt.wait(POLL)
        if _formed and store is not None and self.rank is not None:  # its count stops here: not a lost rank
            with contextlib.suppress(RuntimeError, ValueError, OSError), store_warnings_off():
                store.set(f"{FORMED}{self.rank}", "1")

    def _connect(self):
        """The group's store, with this rank's host and pid left in it; None while no one has opened it."""
        from app.launch.library_noise import store_warnings_off
        from app.launch.signals import pid_namespace

        store = client(self.address, self.port, timeout=POLL)
        if store is not None and self.rank is not None:
            with contextlib.suppress(RuntimeError, ValueError, OSError), store_warnings_off():
                store.set(f"{WHO}{self.rank}", f"{socket.gethostname()}:{pid_namespace()}:{os.getpid()}")
        return store

    def _poll(self, store) -> dict | None:
        """This rank's beat, rank 0's judgement of the others, and this round's failure mark if there is one: read,
        and held on rank 0's host until every rank has read it."""
        if self.rank is not None:
            store.add(f"{BEAT}{self.rank}", 1)
        if self.judge:
            self._judge(store)
        mark = json.loads(store.get(MARK)) if store.check([MARK]) else None
        if mark is None or mark.get("time", 0) < self.since:
            return None
        self.mark_seen.set()
        if self.world_size:
            store.set(WORLD, str(self.world_size))
        answered = store.add(ANSWERED, 1)
        if self.hosts_store:
            self._tell(mark)  # now: the hold below may last seconds
        # (from this thread: a Ctrl-C reaches the main thread, inside init_process_group, only later)
        wait = _Wait(HOLD, "for the other ranks to read it", quiet=not (self.say and self._default), skip="")
        while self.hosts_store and answered < self.world_size and wait.on():
            time.sleep(0.2)
            answered = store.add(ANSWERED, 0)
        return mark

    def stalled_lately(self) -> float:
        """How long this process did not run lately (its watch's longest pause, or the one under way): a process that
        was stopped (SIGSTOP, a frozen machine) and woken; 0 where that is long ago."""
        now = time.monotonic()
        return max(self.stalled if now - self.stalled_at <= STALL_MEMORY else 0.0, now - self.last_poll)

    def _say_unreached(self, seconds: float) -> None:
        """A rank whose group's store no one has opened yet says so, once (it would otherwise wait silently for torch's
        30 minutes: a node started before rank 0, or one whose MASTER_ADDR or MASTER_PORT differs)."""
        if self.say and self._default:
            say(
                f"(waiting for the process group's store at {self.address}:{self.port}, which rank 0 opens: not "
                f"reachable for {seconds:.0f} s. Has rank 0 started, and do all nodes use the same MASTER_ADDR and "
                "MASTER_PORT? torch waits up to 30 minutes)"
            )

    def _tell(self, mark: dict) -> None:
        """Say which rank failed and why (once; where ``say``), unless a caller handles the failure its own way."""
        if self.say and not self._said and self._default:
            self._said = True
            if self.rank is not None and mark.get("rank") == f"rank {self.rank}":  # stopped, then woken: judged lost
                line = (
                    f"error: rank 0 took this rank ({mark['rank']}) for lost before the process group formed "
                    f"({mark.get('why')}); the other ranks have stopped, and so does this one"
                )
            else:
                line = peer_failed_line(mark)
            say(line)

    def _judge(self, store) -> None:
        """Rank 0: leave the mark of the first rank whose count stopped while the group forms (its process gone from
        this host, or ``lost_after`` seconds of silence), counted as having read it (it never will)."""
        import torch.distributed as dist

        from app.launch.signals import pid_namespace, process_alive

        if dist.is_available() and dist.is_initialized():  # formed here: every rank arrived
            return
        now, host = time.monotonic(), socket.gethostname()
        for rank in range(self.world_size):
            if rank == self.rank or not store.check([f"{BEAT}{rank}"]):
                continue  # not arrived yet: it may be slow to start
            count = int(store.get(f"{BEAT}{rank}"))
            if rank not in self._who and store.check([f"{WHO}{rank}"]):
                where, space, pid = store.get(f"{WHO}{rank}").decode().rsplit(":", 2)
                # its pid means something here only on this host and in this process namespace (not a container's)
                here = where == host and space == pid_namespace() and pid.isdigit()
                self._who[rank] = (where, int(pid) if here else 0)
            where, pid = self._who.get(rank, ("", 0))
            if self._counts.get(rank, (None,))[0] != count:
                self._counts[rank] = (count, now)
            if store.check([f"{FORMED}{rank}"]):
                continue
            gone = pid and not process_alive(pid)
            silent = now - self._counts[rank][1]
            if not gone and silent < self.lost_after:
                continue
            why = (
                f"its process (pid {pid}) is gone: killed, or out of memory?"
                if gone
                else f"it has not answered for {silent:.0f} s: killed, stopped, or its machine lost?"
            )
            mark = {"rank": f"rank {rank}", "host": where, "why": why, "time": time.time()}
            if store.compare_set(MARK, "", json.dumps(mark)).decode() == json.dumps(mark):
                store.add(ANSWERED, 1)  # on its behalf: it never reads the mark
            return


def announce_uncaught_exceptions() -> None:
    """An exception that ends the program (a script of the Python API, or ``cli.py`` past its own errors) leaves its
    mark too, after Python's hook has printed it as usual."""
    previous = sys.excepthook

    def hook(kind, value, traceback) -> None:
        previous(kind, value, traceback)  # the traceback first: rank 0 may then keep its store open for a while
        first_line = next(iter(str(value).splitlines()), "")
        announce_failure(f"{kind.__name__}: {first_line}" if first_line else kind.__name__)

    sys.excepthook = hook
