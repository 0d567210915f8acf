"""A test-only callback: the run sends itself a real signal after a given optimizer step, on one rank."""

import os
import signal

from lightning.pytorch import Callback


class SignalAtStep(Callback):
    def __init__(self, step: int, signal_name: str = "SIGTERM", rank: int = 0) -> None:
        self.step, self.signum, self.rank = step, signal.Signals[signal_name], rank

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if trainer.global_step == self.step and trainer.global_rank == self.rank:
            os.kill(os.getpid(), self.signum)
