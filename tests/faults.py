"""A test-only callback that injects one fault at a named point of a run: the elastic and chaos tests' tool.

A fault acts once, in the processes it names (a global rank, or the torchrun node whose agent was started with
``LOSE_THIS_NODE=1``), and only in the launcher start it names (torchrun's ``TORCHELASTIC_RESTART_COUNT`` or the horovod
self-launch's ``TEMPLATE_MPI_RESTART``; 0 is the first start), so a restarted job runs undisturbed. With ``once`` (a
file) and ``start=-1`` it acts in whichever start reaches it first, once across all of them (tests/chaos.py).

Points (``at``), each after optimizer step ``step`` of the run:

- ``step``: at the end of the batch that made the step (``batch`` >= 0: instead at the end of that batch index of the
  first epoch, which with gradient accumulation may lie inside a window);
- ``window``: at the end of a batch inside the accumulation window after the step (one that made no step);
- ``next_batch``: at the start of the next training batch (before its forward);
- ``validation``: at the start of validation batch ``batch`` (default 0) of the validation that follows the step;
- ``save``: inside a checkpoint save (``on_save_checkpoint``).

Actions (``action``): ``kill`` (SIGKILL this process: a lost rank), ``kill_node`` (SIGKILL this worker's torchrun
agent and then itself: a lost machine), ``pause`` (sleep ``seconds``: a slow rank), ``sigterm`` (SIGTERM to this
process: a preemption notice), ``wait_for_harness`` (write ``once``, then wait until a SIGTERM comes: the chaos
harness starts a node that torchrun takes in, or stops the whole job, when it sees the file), ``sigstop`` (a hung
process), ``error`` (a bug: RuntimeError), ``disk_full`` (the save raises ``OSError(ENOSPC)``; only at ``save``),
``kill_before_replace`` and ``kill_after_replace`` (only at ``save``: SIGKILL this process just before, or just after,
the ``os.replace`` that puts the checkpoint file being saved in place: a rank killed in the middle of its save),
``hang_mpirun_then_kill`` (SIGSTOP this rank's mpirun, then SIGKILL this process: a rank lost, and an mpirun that
will not exit once the other ranks are gone, as Open MPI 5's prterun hung in its abort in CI).
"""

from __future__ import annotations

import errno
import os
import signal
import time

from lightning.pytorch import Callback

POINTS = ("step", "window", "next_batch", "validation", "save")
ACTIONS = (
    "kill",
    "kill_node",
    "pause",
    "sigterm",
    "wait_for_harness",
    "sigstop",
    "error",
    "disk_full",
    "kill_before_replace",
    "kill_after_replace",
    "hang_mpirun_then_kill",
)


def launcher_start() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", os.environ.get("TEMPLATE_MPI_RESTART", "0")))


class Fault(Callback):
    def __init__(
        self,
        at: str,
        step: int,
        action: str,
        rank: int = -1,
        node: bool = False,
        start: int = 0,
        batch: int = -1,
        seconds: float = 0.0,
        once: str = "",
    ) -> None:
        """
        Args:
            at: Where: one of ``POINTS``.
            step: After which optimizer step.
            action: What: one of ``ACTIONS``.
            rank: The global rank that acts (-1: every rank, or the node's with ``node``).
            node: Act only in the worker whose agent has ``LOSE_THIS_NODE=1`` in its environment.
            start: The launcher start it acts in (0: the first; -1: any, with ``once``).
            batch: ``at="step"``: a batch index of the first epoch instead of a step; ``at="validation"``: which
                validation batch (default 0).
            seconds: ``action="pause"``: how long; ``wait_for_harness``: the longest wait.
            once: A file: the fault acts only while it does not exist, and creates it first (across restarts).
        """
        if at not in POINTS or action not in ACTIONS:
            raise ValueError(f"Fault(at={at!r}, action={action!r}): at is one of {POINTS}, action one of {ACTIONS}")
        self.at, self.step, self.action, self.rank, self.node = at, step, action, rank, node
        self.start, self.batch, self.seconds, self.once = start, batch, seconds, once
        self.done = False
        self._step_at_batch_start = -1

    def _mine(self, trainer) -> bool:
        if self.done or (self.start >= 0 and launcher_start() != self.start):
            return False
        if self.once and os.path.exists(self.once):
            return False
        if self.node and os.environ.get("LOSE_THIS_NODE") != "1":
            return False
        return self.rank < 0 or trainer.global_rank == self.rank

    def _act(self, trainer=None) -> None:
        self.done = True
        if self.once:
            with open(self.once, "a") as f:  # every rank may act (sigterm_agent): each appends its line
                f.write(f"{os.getpid()} {time.time()}\n")
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "kill_node":
            os.kill(os.getppid(), signal.SIGKILL)  # the agent: it cannot restart this worker
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "pause":
            time.sleep(self.seconds)
        elif self.action == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.action == "wait_for_harness":  # the chaos harness acts when it sees ``once`` (starts a node,
            from app.callbacks import Preemption  # stops the job): wait until that stops this worker with SIGTERM

            [preemption] = [c for c in trainer.callbacks if isinstance(c, Preemption)]
            deadline = time.monotonic() + (self.seconds or 240)
            while not preemption.received and time.monotonic() < deadline:
                time.sleep(0.1)
        elif self.action == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.action == "error":
            raise RuntimeError("a fault injected by tests/faults.py")
        elif self.action == "disk_full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        elif self.action == "hang_mpirun_then_kill":
            from app.launch.launcher import mpi_daemon

            daemon = mpi_daemon()
            assert daemon is not None, "hang_mpirun_then_kill: this rank has no mpirun"
            os.kill(daemon[0], signal.SIGSTOP)
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action in ("kill_before_replace", "kill_after_replace"):
            _kill_at_checkpoint_replace(after=self.action == "kill_after_replace")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        stepped = trainer.global_step != self._step_at_batch_start
        if self.at == "window" and not stepped and trainer.global_step == self.step and self._mine(trainer):
            self._act(trainer)  # after a batch inside an accumulation window
            return
        if self.at != "step" or not self._mine(trainer):
            return
        if (
            (batch_idx == self.batch and trainer.current_epoch == 0)
            if self.batch >= 0
            else trainer.global_step == self.step
        ):
            self._act(trainer)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        self._step_at_batch_start = trainer.global_step
        if self.at == "next_batch" and self._mine(trainer) and trainer.global_step == self.step:
            self._act(trainer)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        at_batch = batch_idx == max(self.batch, 0) and trainer.global_step == self.step
        if self.at == "validation" and not trainer.sanity_checking and at_batch and self._mine(trainer):
            self._act(trainer)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self.at == "save" and self._mine(trainer) and trainer.global_step >= self.step:
            self._act(trainer)


def _kill_at_checkpoint_replace(after: bool) -> None:
    """From now on, the ``os.replace`` that puts a ``.ckpt`` file in place SIGKILLs this process just before it
    (``after=False``: the file is complete under its temporary name) or just after it (the file is in place, and
    nothing that follows the rename in the save runs)."""
    replace = os.replace

    def replace_then_kill(src, dst, *args, **kwargs):
        if str(dst).endswith(".ckpt") and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        replace(src, dst, *args, **kwargs)
        if str(dst).endswith(".ckpt"):
            os.kill(os.getpid(), signal.SIGKILL)

    os.replace = replace_then_kill


class PerturbRestore(Callback):
    """A broken restore, to prove that the chaos check notices one: every resumed or restarted run gets its weights
    moved by ``shift`` and its optimizer's state (momentum) dropped, as a loader that mangles checkpoints would."""

    def __init__(self, shift: float = 0.05) -> None:
        self.shift = shift

    def on_load_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        import torch

        with torch.no_grad():  # the weights are in the module already (Lightning restores callbacks after them)
            for parameter in pl_module.parameters():
                parameter.add_(self.shift)
        for state in checkpoint.get("optimizer_states", []):
            state["state"] = {}
