"""A test-only callback that injects one fault at a named point of a run: the elastic and chaos tests' tool.

A fault acts once, in the processes it names (a global rank, or the torchrun node whose agent was started with
``LOSE_THIS_NODE=1``), and only in the launcher start it names (torchrun's ``TORCHELASTIC_RESTART_COUNT`` or the horovod
self-launch's ``TEMPLATE_MPI_RESTART``; 0 is the first start), so a restarted job runs undisturbed.

Points (``at``), each after optimizer step ``step`` of the run:

- ``step``: at the end of the batch that made the step (``batch`` >= 0: instead at the end of that batch index of the
  first epoch, which with gradient accumulation may lie inside a window);
- ``next_batch``: at the start of the next training batch (before its forward);
- ``validation``: at the start of validation batch ``batch`` (default 0) of the validation that follows the step;
- ``save``: inside a checkpoint save (``on_save_checkpoint``).

Actions (``action``): ``kill`` (SIGKILL this process: a lost rank), ``kill_node`` (SIGKILL this worker's torchrun
agent and then itself: a lost machine), ``pause`` (sleep ``seconds``: a slow rank), ``sigterm`` (SIGTERM to this
process: a preemption notice), ``sigstop`` (a hung process), ``error`` (a bug: RuntimeError), ``disk_full`` (the
save raises ``OSError(ENOSPC)``; only at ``save``).
"""

from __future__ import annotations

import errno
import os
import signal
import time

from lightning.pytorch import Callback

POINTS = ("step", "next_batch", "validation", "save")
ACTIONS = ("kill", "kill_node", "pause", "sigterm", "sigstop", "error", "disk_full")


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
    ) -> None:
        """
        Args:
            at: Where: one of ``POINTS``.
            step: After which optimizer step.
            action: What: one of ``ACTIONS``.
            rank: The global rank that acts (-1: every rank, or the node's with ``node``).
            node: Act only in the worker whose agent has ``LOSE_THIS_NODE=1`` in its environment.
            start: The launcher start it acts in (0: the first).
            batch: ``at="step"``: a batch index of the first epoch instead of a step; ``at="validation"``: which
                validation batch (default 0).
            seconds: ``action="pause"``: how long.
        """
        if at not in POINTS or action not in ACTIONS:
            raise ValueError(f"Fault(at={at!r}, action={action!r}): at is one of {POINTS}, action one of {ACTIONS}")
        self.at, self.step, self.action, self.rank, self.node = at, step, action, rank, node
        self.start, self.batch, self.seconds = start, batch, seconds
        self.done = False

    def _mine(self, trainer) -> bool:
        if self.done or launcher_start() != self.start:
            return False
        if self.node and os.environ.get("LOSE_THIS_NODE") != "1":
            return False
        return self.rank < 0 or trainer.global_rank == self.rank

    def _act(self) -> None:
        self.done = True
        if self.action == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "kill_node":
            os.kill(os.getppid(), signal.SIGKILL)  # the agent: it cannot restart this worker
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.action == "pause":
            time.sleep(self.seconds)
        elif self.action == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.action == "sigstop":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif self.action == "error":
            raise RuntimeError("a fault injected by tests/faults.py")
        elif self.action == "disk_full":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.at != "step" or not self._mine(trainer):
            return
        if (
            (batch_idx == self.batch and trainer.current_epoch == 0)
            if self.batch >= 0
            else trainer.global_step == self.step
        ):
            self._act()

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.at == "next_batch" and self._mine(trainer) and trainer.global_step == self.step:
            self._act()

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        at_batch = batch_idx == max(self.batch, 0) and trainer.global_step == self.step
        if self.at == "validation" and not trainer.sanity_checking and at_batch and self._mine(trainer):
            self._act()

    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        if self.at == "save" and self._mine(trainer) and trainer.global_step >= self.step:
            self._act()
