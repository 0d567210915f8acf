"""A test-only callback for SLURM jobs: every rank holds after a given optimizer step of the job's first start, until
a stop signal reaches it (or ``seconds`` pass), so that the test stops the job there (``scontrol requeue``, its time
limit, a preemption, ``scancel``) mid-epoch, however fast the machine. Rank 0 writes ``held`` in ``folder`` when it
holds, ``signalled`` once a stop signal has come (its number, and the wall time it came at: Preemption's own record,
even of a signal kept while the rank started), and a line per optimizer step to
``steps.jsonl`` (start, step, wall time): the time from a stop to the first step of the next start."""

import json
import os
import time
from pathlib import Path

from lightning.pytorch import Callback

from app.callbacks.stop_plan import stop_plan


def this_start() -> int:
    """0 in a job's first start, N after SLURM requeued it N times."""
    return int(os.environ.get("SLURM_RESTART_COUNT") or 0)


class HoldAtStep(Callback):
    def __init__(self, folder: str, step: int = 3, seconds: float = 240.0, rank: int = -1, linger: float = 0.0) -> None:
        """
        Args:
            folder: Where ``held`` and ``steps.jsonl`` are written (rank 0).
            step: The optimizer step after which the ranks hold, in the job's first start only.
            seconds: The longest hold.
            rank: Only this global rank holds (-1: every rank).
            linger: Seconds rank 0 takes to leave after a stop, before its loggers end (a slow machine, a logger
                that uploads): a requeue that SLURM carries out meanwhile stops every process of the job.
        """
        self.folder, self.step, self.seconds, self.rank = Path(folder), step, seconds, rank
        self.linger = linger

    def _note_signal(self, trainer) -> None:
        """``signalled``, once rank 0's Preemption has a signal: written from whichever hook sees it first (Preemption
        may stop the run in its own hook of the same step, before this callback's)."""
        preemption = stop_plan(trainer).preemption
        signalled = self.folder / "signalled"
        if not trainer.is_global_zero or preemption is None or not preemption.received or signalled.exists():
            return
        at = time.time() - (time.monotonic() - preemption.received_at)
        signalled.write_text(json.dumps({"signal": preemption.received, "time": at}))

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        self._note_signal(trainer)
        if trainer.is_global_zero and self.linger:
            time.sleep(self.linger)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        preemption = stop_plan(trainer).preemption
        if trainer.is_global_zero:
            line = {"start": this_start(), "step": trainer.global_step, "time": time.time()}
            with (self.folder / "steps.jsonl").open("a") as f:
                f.write(json.dumps(line) + "\n")
        self._note_signal(trainer)
        if trainer.global_step != self.step or this_start() != 0 or self.rank not in (-1, trainer.global_rank):
            return
        if trainer.is_global_zero:
            (self.folder / "held").write_text(json.dumps({"step": self.step, "time": time.time()}))
        deadline = time.monotonic() + self.seconds
        while time.monotonic() < deadline and not (preemption is not None and preemption.received):
            time.sleep(0.1)
        self._note_signal(trainer)
