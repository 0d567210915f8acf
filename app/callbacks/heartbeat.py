"""The rank watchdog's heartbeat: one thread per rank that judges when a peer is lost (:class:`Heartbeat`).

Every ``interval`` seconds the thread bumps its rank's counter in the rendezvous store that ``torch.distributed``
already runs (:func:`rendezvous_store`) and reads the others'. What it decides is a verdict (the ranks lost, and why),
which :class:`~app.callbacks.RankWatchdog` (app/callbacks/rank_watchdog.py) turns into one line and the end of the
process. Kept apart from the callback so that each can be read on its own.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_debug

from app.launch.connections import close_connections_to, local_addresses
from app.launch.library_noise import store_warnings_off
from app.launch.signals import pid_namespace, process_alive

DONE = -(1 << 40)  # added to a rank's counter when it finishes
FAILED = 2 * DONE  # added instead when it leaves with an error (not a planned stop: preemption, divergence)


def _failed(beat: int) -> bool:
    return beat < (DONE + FAILED) // 2  # a heartbeat counter plus FAILED, not plus DONE


def rendezvous_store(trainer, timeout: float):
    """A client of the store the process group met at (the cluster environment's main address and port), or None.

    Every launcher here (Lightning's ddp and ddp_spawn, torchrun, the horovod strategy's ``tcp://`` init) forms the
    group through a ``TCPStore`` at that address, hosted by rank 0 or torchrun's agent.
    """
    try:
        environment = trainer.strategy.cluster_environment  # a parallel strategy's (one device: none)
        return dist.TCPStore(
            environment.main_address,
            environment.main_port,
            is_master=False,
            timeout=timedelta(seconds=timeout),
            wait_for_workers=False,
        )
    except (AttributeError, RuntimeError, ValueError, OSError, TypeError) as err:
        rank_zero_debug(f"RankWatchdog: no rendezvous store ({err}); not watching")
        return None


class Heartbeat(threading.Thread):
    """The watchdog thread of one rank. ``lost_ranks`` becomes non-empty when a peer is judged dead."""

    def __init__(self, store, rank: int, world_size: int, timeout: float, interval: float, prefix: str) -> None:
        super().__init__(name=f"rank-watchdog-{rank}", daemon=True)
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout, self.interval, self.prefix = timeout, interval, prefix
        self.lost_ranks: list[int] = []
        self.reason = ""
        self.silent = False  # the verdict came from silence (a peer's heartbeat, rank 0's store), not an exit or error
        self.across_hosts = False  # ... of a rank on another host (or one not yet placed): the network may have failed
        self.verdict = threading.Event()
        self._halt = threading.Event()  # not "_stop": that is a threading.Thread method
        self.on_lost = None  # called from this thread with (ranks, reason); default: exit the process
        self._call: threading.Thread | None = None  # the store call under way (a helper thread: it may hang)
        self.pids: dict[int, int] = {}  # peer rank -> its pid where it runs on this host (0: another host)
        self.addresses: dict[int, set[str]] = {}  # peer rank -> the addresses its connections have at its end
        self.met = threading.Event()  # every peer's pid and addresses are known (read while the network is whole)

    def _key(self, kind: str, rank: int) -> str:
        return f"{self.prefix}/{kind}/{rank}"

    def run(self) -> None:
        try:
            self._watch()
        finally:
            _running.discard(self)

    def _watch(self) -> None:
        host = socket.gethostname()
        peers = [r for r in range(self.world_size) if r != self.rank]
        try:
            self.store.set(self._key("pid", self.rank), f"{host}:{pid_namespace()}:{os.getpid()}")
            self.store.set(self._key("addresses", self.rank), " ".join(local_addresses()))
        except Exception as err:  # noqa: BLE001 (no store: nothing to watch)
            rank_zero_debug(f"RankWatchdog: store unusable ({err}); not watching")
            return
        pids = self.pids
        seen = {r: (None, time.monotonic()) for r in peers}
        meeting_until = time.monotonic() + self.timeout  # peers read 20 times an interval until met (or for timeout)
        while not self._halt.wait(self.interval / (1 if self.met.is_set() or time.monotonic() > meeting_until else 20)):
            # A store whose host process is stopped (SIGSTOP, a hung machine) accepts the connection but never
            # answers, and torch's store calls can then block far beyond their timeout: make the calls from a
            # helper thread and give up on them after ``timeout``.
            outcome: dict = {}
            call = self._call = threading.Thread(target=self._exchange, args=(peers, host, pids, outcome), daemon=True)
            call.start()
            call.join(self.timeout)
            if call.is_alive() or "error" in outcome:
                if self._halt.wait(2 * self.interval):  # finishing normally: the store closes as rank 0 exits
                    return
                if not call.is_alive() and "error" not in outcome:  # it answered late (rank 0 stalled, then went
                    continue  # on): slow, not gone; watch on
                why = (
                    f"has not answered for {self.timeout:.0f} s (its process is stopped or hangs)"
                    if call.is_alive()
                    else f"stopped answering ({type(outcome['error']).__name__})"
                )
                self.silent = True
                self.across_hosts = not pids.get(0)
                self._judge([0], f"the rendezvous store on rank 0 {why}")
                return
            lost, reasons = self._lost_peers(peers, outcome["beats"], pids, seen, host)
            if lost:
                self._judge(lost, "; ".join(reasons))
                return

    def _lost_peers(self, peers, beats: dict, pids: dict[int, int], seen: dict, host: str) -> tuple[list, list]:
        """The peers lost by this heartbeat's counts, and why each: one that stopped with an error, one whose process
        on this host exited unfinished, one whose count stood still for ``timeout`` seconds (``seen``: each peer's
        last count and when it changed, updated here)."""
        now = time.monotonic()
        lost, reasons = [], []
        for r in peers:
            if _failed(beats[r]):
                lost.append(r)
                reasons.append(f"rank {r} stopped with an error (its output above says which)")
            elif beats[r] < 0:  # finished
                continue
            elif pids.get(r) and not process_alive(pids[r]):
                if not self._finished(r):  # (one that marked itself done, then exited, is not lost)
                    lost.append(r)
                    reasons.append(f"rank {r} (pid {pids[r]} on {host}) has exited")
            elif beats[r] != seen[r][0]:
                seen[r] = (beats[r], now)
            elif now - seen[r][1] > self.timeout:
                self.silent = True
                self.across_hosts = self.across_hosts or not pids.get(r)  # not a process seen on this host
                lost.append(r)
                reasons.append(f"rank {r} has not answered for {now - seen[r][1]:.0f} s")
        return lost, reasons

    def _exchange(self, peers: list[int], host: str, pids: dict[int, int], outcome: dict) -> None:
        """One heartbeat: bump this rank's counter, read the peers' (and their pids, once). Fills ``outcome``."""
        try:
            with store_warnings_off():  # its failure (the store's host is gone) is a verdict, said in one line
                self.store.add(self._key("beat", self.rank), 1)
                outcome["beats"] = {r: self.store.add(self._key("beat", r), 0) for r in peers}
                for r in peers:
                    if r not in pids and self.store.check([self._key("pid", r)]):
                        peer_host, space, pid = self.store.get(self._key("pid", r)).decode().rsplit(":", 2)
                        # a pid of this host's and this pid namespace (not another container's) can be checked here
                        pids[r] = int(pid) if (peer_host, space) == (host, pid_namespace()) else 0
                    if r not in self.addresses and self.store.check([self._key("addresses", r)]):
                        self.addresses[r] = set(self.store.get(self._key("addresses", r)).decode().split())
                if all(r in pids and r in self.addresses for r in peers):
                    self.met.set()
        except Exception as err:  # noqa: BLE001 (the store's host is gone, or the network)
            outcome["error"] = err

    def close_connections(self, ranks: list[int]) -> int:
        """Shut down this process's connections to the lost ``ranks`` (:mod:`app.launch.connections`): a collective
        waiting on one of them fails at once, on the training thread, as when a peer's process dies. A peer on this
        host is found by its pid, one on another host by its addresses; returns how many were shut down."""
        ours = set(local_addresses())
        closed = 0
        for rank in ranks:
            if self.pids.get(rank):
                closed += close_connections_to(pid=self.pids[rank])
            else:
                closed += close_connections_to(self.addresses.get(rank, set()) - ours)
        return closed

    def _finished(self, rank: int) -> bool:
        try:
            with store_warnings_off():
                beat = self.store.add(self._key("beat", rank), 0)
        except Exception:  # noqa: BLE001
            return False
        return beat < 0 and not _failed(beat)

    def _judge(self, ranks: list[int], reason: str) -> None:
        self.lost_ranks, self.reason = ranks, reason
        self.verdict.set()
        if self.on_lost is not None:
            self.on_lost(ranks, reason)

    def start(self) -> None:
        _register_exit_wait()
        _running.add(self)
        super().start()

    def finish(self, failed: bool = False) -> None:
        """This rank is done (``failed``: it leaves with an error): peers stop watching it, and this thread stops."""
        self._halt.set()
        with contextlib.suppress(Exception), store_warnings_off():  # the store may already be gone at the very end
            self.store.add(self._key("beat", self.rank), FAILED if failed else DONE)
        self.wait_stopped()

    def wait_stopped(self) -> None:
        """Return once this thread and its store call are over: at most ``timeout + interval`` seconds (a store call
        gives up after ``timeout``), and not after a verdict, whose thread ends the process itself.

        A daemon thread that comes back from one of torch's C++ calls while the interpreter shuts down ends the
        process with SIGABRT, "terminate called without an active exception" (CPython ends such a thread with
        pthread_exit, whose unwinding cannot pass torch's C++ frames). Seen on ddp_spawn ranks that had stopped
        cleanly and saved, when rank 0, the store's host, exited first and a peer's store call then failed."""
        self._halt.set()
        if threading.current_thread() is self:
            return
        deadline = time.monotonic() + self.timeout + self.interval
        # not once a verdict came: its thread waits for this one's save (the Elastic callback) and ends the process
        for thread in (self, self._call):
            while thread is not None and thread.is_alive() and not self.verdict.is_set():
                if time.monotonic() > deadline:
                    return
                thread.join(0.05)


_running: set[Heartbeat] = set()  # the heartbeat threads of this process that have not stopped
_exit_wait_registered = False


def _register_exit_wait() -> None:
    """At the interpreter's exit (atexit runs before it shuts down), every heartbeat still running is stopped and
    waited for (:meth:`Heartbeat.wait_stopped`): a rank that leaves without the callback's teardown (an exception
    raised past Lightning, ``sys.exit`` in a user's hook) exits cleanly too. Registered with the first heartbeat."""
    global _exit_wait_registered
    if not _exit_wait_registered:
        atexit.register(lambda: [beat.wait_stopped() for beat in list(_running)])
        _exit_wait_registered = True
