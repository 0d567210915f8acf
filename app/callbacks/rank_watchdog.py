"""RankWatchdog: when a rank dies (SIGKILL, the OOM killer, a lost node), the others stop in bounded time and say which.

Without it a dead rank shows up as a gloo ``Connection reset by peer`` traceback that names no rank, or, with
NCCL, as a collective that hangs until the process group's timeout (30 minutes by default).

Every rank runs a daemon thread (:class:`~app.callbacks.heartbeat.Heartbeat`) that, every ``interval`` seconds,
bumps its own counter in the rendezvous store that ``torch.distributed`` already runs (the TCPStore of
``MASTER_ADDR:MASTER_PORT``, hosted by rank 0) and reads the others'. A rank is lost when

- its process is gone (peers on the same host check its pid: immediate), or
- its counter has not moved for ``timeout`` seconds (another host, or a process that hangs), or
- the store itself stops answering (rank 0, its host, is gone).

A rank that leaves with an error marks itself failed, and the others stop at once too. The thread then prints one
line naming the rank, kills this rank's own child ranks (rank 0 of a ``ddp`` launch started the local ones: it
watches them in place of Lightning's observer, which would SIGKILL every process, itself included, without a word)
and exits with code 1; it cannot raise into a main thread that is blocked inside a
collective. Under a restarting launcher the :class:`~app.callbacks.Elastic` callback first saves this survivor's
state, on the training thread. A peer that died closed its connections, so this rank's collective fails and the
training thread saves. A cut link or a hung host closes nothing, and gloo would wait for good: the verdict shuts this
process's connections to the lost rank down (:mod:`app.launch.connections`), so that the collective fails the same
way, at once, and waits for the save. No checkpoint is written from this thread.
Under ``fsdp`` and ``pipeline`` no survivor holds the whole state: the verdict then promises no save, and the Elastic
callback says that none is written. A stop signal that came first (torchrun's agent sends the other workers SIGTERM
when one dies) announced a checkpoint if every rank finished the step; the verdict says it is not written.
A rank that finishes marks itself done, so an early finisher is never taken for a dead one.
What it hands the Elastic callback and reads from Preemption is written in :mod:`app.callbacks.stop_plan`.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import NoReturn

import torch.distributed as dist
from lightning.pytorch import Callback
from typing_extensions import override

from app.callbacks.heartbeat import Heartbeat, rendezvous_store
from app.callbacks.stop_plan import StopPlan, stop_plan
from app.checkpoints.storage import run_path
from app.errors import UserError
from app.launch.formation import stop_process
from app.launch.host_address import answers
from app.launch.launcher import TorchrunAgent, mpi_daemon, torchrun_agent
from app.launch.restarts import restart_after_failure, restarts_left
from app.launch.signals import exit_taken_over
from app.lightning_internals import take_over_local_ranks
from app.parallelism import parallelism

EXIT_CODE = 1
MIN_TIMEOUT = 1.0


REJOIN = (
    "this node lost the network: its torchrun agent is stopped too, so that it cannot close the rendezvous the "
    "other nodes go on with; once the network is back, start the same command here again and the node rejoins the job"
)


def what_next(last: Path | None, cut_off: bool = False) -> str:
    """What a rank that stops after a lost peer tells the user: a restart is promised only when one is left."""
    if cut_off:
        return REJOIN[0].upper() + REJOIN[1:]
    saved = last is not None and last.exists()  # a file, or fsdp's sharded folder
    if restarts_left():
        then = restart_after_failure()
        return then[0].upper() + then[1:] + (f" from {last}" if saved else "")
    if saved:
        return f"{last} is intact: restart with the same command plus --ckpt_path last"
    return "No checkpoint was written yet: restart with the same command"


class RankWatchdog(Callback):
    stop_role = "watchdog"  # in the trainer's stop plan (app/callbacks/stop_plan.py)

    def __init__(self, timeout: float = 15.0, interval: float | None = None) -> None:
        """
        Args:
            timeout: Seconds without a heartbeat after which a rank on another host counts as lost. A rank on
                the same host whose process has exited is noticed within ``interval``.
            interval: Seconds between heartbeats (default: timeout / 10, at most 1).
        """
        # Below a second, a busy machine's store calls alone outlast the timeout: healthy ranks were judged lost.
        if not math.isfinite(timeout) or timeout < MIN_TIMEOUT:
            raise UserError(
                f"--watchdog.timeout={timeout:g}: use a number of seconds >= {MIN_TIMEOUT:g} (default 15); a rank is "
                "judged lost after this long without a heartbeat"
            )
        if interval is not None and (not math.isfinite(interval) or interval <= 0 or interval > timeout):
            raise UserError(
                f"--watchdog.interval={interval:g}: use a number of seconds > 0 and <= --watchdog.timeout, or leave "
                "it unset"
            )
        self.timeout = float(timeout)
        self.interval = float(interval) if interval else min(1.0, self.timeout / 10)
        self._heartbeat: Heartbeat | None = None
        self._children: list = []
        self._checkpointer = None
        self._save: threading.Event | None = None  # set when the survivor's save (expect_save) is over
        self.closed = False  # the verdict shut the lost ranks' connections down (the failed collective says nothing)
        self.cut_off: TorchrunAgent | None = None  # this node lost the network: its agent, stopped with the process
        self.verdict: str | None = None  # a cut-off node's verdict, said by the save's line (one line in all)
        self.mpi_daemon: tuple[int, str] | None = None  # a rank on another host fell silent: mpirun, stopped with it
        self._save_reported = False
        self._strategy = None  # what the verdict's line says depends on it (sharded or not)
        self._plan: StopPlan | None = None  # Preemption's signal changes what the verdict says; before_exit
        self._ending = threading.Event()  # never set: what the training thread waits on while a verdict ends it

    def __getstate__(self) -> dict:
        # The horovod self-launch pickles the trainer into its ranks: the launching process's cleanups stay there.
        return {
            **self.__dict__,
            **{"_plan": None, "cut_off": None, "mpi_daemon": None, "_ending": None},
        }

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, _ending=threading.Event())

    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        self._plan = stop_plan(trainer)
        self._plan.join(trainer, self)
        if trainer.world_size == 1 or not dist.is_initialized():
            return
        store = rendezvous_store(trainer, self.timeout)
        if store is None:
            return
        self._children = take_over_local_ranks(trainer)  # Lightning's observer would SIGKILL everything first
        self._checkpointer = trainer.checkpoint_callback  # its dirpath is known only later
        self._strategy = trainer.strategy
        self._heartbeat = Heartbeat(
            store, trainer.global_rank, trainer.world_size, self.timeout, self.interval, f"rank-watchdog/{stage}"
        )
        self._heartbeat.on_lost = self._stop_process
        self._heartbeat.start()

    def _stop_process(self, ranks: list[int], reason: str) -> None:
        exit_taken_over(self.timeout + 3 * self.interval + 10)  # this thread ends the process (_end): let it
        me = self._heartbeat.rank if self._heartbeat else "?"
        lost = self._verdict(me, ranks, reason)
        save = self._save
        if save is not None and save.is_set() and self._save_reported:  # its line came first and said what next
            _say(f"{lost} {self._stopping()}.")
            self._end()
        if save is not None and not save.is_set():
            lost = self._await_save(save, lost, me)
        folder = getattr(self._checkpointer, "dirpath", None)
        advice = what_next(run_path(folder) / "last.ckpt" if folder else None, cut_off=self.cut_off is not None)
        _say(f"{lost} {self._stopping()}{self._no_signal_checkpoint()}. {advice}")
        self._end()

    def _verdict(self, me, ranks: list[int], reason: str) -> str:
        """The line naming the lost rank, or saying that this rank lost the network (a peer silent, and under torchrun
        the rendezvous host too)."""
        lost = f"error: [rank {me}] lost rank {', '.join(map(str, ranks))}: {reason}."
        if self._heartbeat is not None and self._heartbeat.silent and self._heartbeat.across_hosts:
            # mpirun (or this node's daemon) would wait, for as long as the network is down, for the lost node's
            # daemon to stop its ranks: it is ended with this rank
            self.mpi_daemon = mpi_daemon()
        if self._heartbeat is not None and self._heartbeat.silent:
            self.cut_off = self._lost_the_network()
            if self.cut_off is not None:
                where = self.cut_off.where
                lost = f"error: [rank {me}] lost the network: {reason.split(' (')[0]}, and the rendezvous host {where} "
                lost += "does not answer either."
        return lost

    def _await_save(self, save: threading.Event, lost: str, me) -> str:
        """The survivor's save after a verdict, at most ``timeout`` seconds: ends the process once it is written and
        reported; else returns the line to stop with.

        The training thread saves when its collective fails: the Elastic callback writes the state of the last step
        (or, under fsdp and pipeline, says why it cannot: the lost rank's part of the state is gone) and says what
        next. A peer that died closed its connections; those of a cut link or a hung host are shut down here, so that
        a collective waiting on them fails at once (gloo waits for good on them). A cut-off node's verdict and save
        are one line, the save's."""
        one_line = self.cut_off is not None and not self._sharded()
        if self._sharded():
            _say(f"{lost} Stopping this rank when its next collective fails, within {self.timeout:g} s")
        elif not one_line:
            _say(f"{lost} Saving this rank's state first")
        self.verdict, self.closed = (lost if one_line else None), True
        if self._heartbeat is not None:
            self._heartbeat.close_connections(self._heartbeat.lost_ranks)
        if not save.wait(self.timeout):
            return (
                f"error: [rank {me}] {'' if self._sharded() else 'could not save its state: '}no collective "
                f"failed within {self.timeout:g} s (one that hangs: a peer's host that is gone without closing "
                "its connections)."
            )
        if self._save_reported:
            self._end()  # the state is written (or it said why not), and what comes next
        return lost if one_line else f"error: [rank {me}]"

    def _lost_the_network(self) -> TorchrunAgent | None:
        """Under torchrun, when a peer or rank 0's store fell silent: this worker's agent, if the rendezvous host it
        meets the other nodes at does not answer either (this node is cut off, or that host is gone, which ends
        the job anyway). Left running, the agent would wait to re-join until the network returns, then close the
        rendezvous for every node (torch's agent does on its way out)."""
        agent = torchrun_agent()
        if agent is None or agent.endpoint is None:
            return None
        return None if answers(*agent.endpoint, timeout=min(3.0, self.timeout)) else agent

    def _stopping(self) -> str:
        if self.mpi_daemon is None:
            return f"Stopping this rank (exit {EXIT_CODE})"
        name = self.mpi_daemon[1]
        return f"Stopping this rank (exit {EXIT_CODE}) and {name}, which cannot reach the lost node to end the job"

    def _sharded(self) -> bool:
        """fsdp, pipeline: each rank holds a part of the state, and a lost rank's part is gone (nothing to save)."""
        return parallelism(self._strategy).sharded

    def _no_signal_checkpoint(self) -> str:
        """A stop signal came first (a launcher stops the other workers when one dies: torchrun, srun), and its
        line said a checkpoint follows once every rank has finished the step: one rank never will."""
        preemption = None if self._plan is None else self._plan.preemption
        signum = 0 if preemption is None else preemption.received
        if not signum:
            return ""
        return f" without the checkpoint {signal.Signals(signum).name} asked for: it needs every rank"

    def _end(self) -> NoReturn:
        for process in self._children:  # the local ranks this process started
            if process.poll() is None:
                process.send_signal(signal.SIGKILL)
        # torch's agent at once, before it can close the rendezvous (and with no traceback, which SIGTERM gives); mpirun
        # once it has passed this rank's line on (it reads the ranks' output), before it waits for the lost node
        if self.cut_off is not None:
            with contextlib.suppress(OSError):
                os.kill(self.cut_off.pid, signal.SIGKILL)
        if self.mpi_daemon is not None:
            time.sleep(1.0)
            with contextlib.suppress(OSError):
                os.kill(self.mpi_daemon[0], signal.SIGKILL)
        # the main thread may be stuck in a collective: it cannot be unwound. The cleanups are what the process would
        # do on its way out (the CLI's removal of an unused run folder, the trackers' runs ended)
        stop_process(None, self._plan.before_exit if self._plan else ())

    def expect_save(self) -> None:
        """Called before training by a callback that writes this rank's state when a peer is lost (the
        :class:`~app.callbacks.Elastic` callback under a restarting launcher): a verdict then lets this process live
        until :meth:`save_over`, or ``timeout`` seconds."""
        self._save = threading.Event()
        self._save_reported = False

    def save_over(self, reported: bool) -> None:
        """The save that :meth:`expect_save` announced is done, or will not happen; ``reported``: the callback
        said so, and what comes next, in its own line."""
        self._save_reported = reported
        if self._save is not None:
            self._save.set()

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        # Where each peer's connections end is read while the network is whole: a verdict may have to shut them down
        if self._heartbeat is not None:
            self._heartbeat.met.wait(self.timeout)

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        # A collective that failed because a peer died (gloo: "Connection reset by peer") reaches here before the
        # heartbeat verdict: wait for the verdict, which names the rank and exits. Otherwise this rank is leaving.
        if self._heartbeat is not None and _looks_like_lost_peer(exception):
            self._heartbeat.verdict.wait(self.timeout + 3 * self.interval)
        if self._heartbeat is not None and self._heartbeat.verdict.is_set() and self._save is None:
            # The verdict's thread says its line, runs the cleanups (a run folder of a run that trained nothing is
            # removed) and ends the process; no save is waited for. This thread must write nothing meanwhile: the
            # loggers' finalize (Lightning's next step here) wrote metrics.csv back into the removed folder (seen
            # under load). Bounded, should that thread fail to end the process.
            self._ending.wait(self.timeout + 3 * self.interval + 5)
        if self._heartbeat is not None and self._heartbeat.verdict.is_set():
            return  # the verdict's thread ends the process, after the save announced by expect_save, if any
        planned = isinstance(exception, SystemExit | KeyboardInterrupt)  # all ranks stop together (a preemption)
        self._finish(failed=not planned)  # the save announced by expect_save, if any, comes after (in turn)

    @override
    def teardown(self, trainer, pl_module, stage: str) -> None:
        self._finish()
        if self._save is not None and not self._save.is_set():
            self.save_over(reported=False)  # ended without a failure to save after

    def _finish(self, failed: bool = False) -> None:
        if self._heartbeat is not None:
            self._heartbeat.finish(failed)
            self._heartbeat = None


def _say(line: str) -> None:
    os.write(2, (line + "\n").encode())


def _looks_like_lost_peer(exception: BaseException) -> bool:
    if isinstance(exception, getattr(dist, "DistError", ())):
        return True
    text = str(exception).lower()
    return isinstance(exception, RuntimeError) and any(
        word in text for word in ("gloo", "nccl", "connection", "peer", "socket", "timed out")
    )
