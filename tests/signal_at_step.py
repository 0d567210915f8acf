"""A test-only callback: the run sends itself a real signal after a given optimizer step, on one rank."""

import os
import signal

from lightning.pytorch import Callback


class SignalAtStep(Callback):
    def __init__(
        self,
        step: int = -1,
        signal_name: str = "SIGTERM",
        rank: int = 0,
        validation_batch: int = -1,
        times: int = 1,
        batch: int = -1,
    ) -> None:
        """
        Args:
            step: The optimizer step after which the signal is sent.
            validation_batch: When >= 0, send it instead as that batch of the validation after ``step`` starts.
            times: How many signals to send at once (2: the second one arrives before the run can act on the first).
            batch: When >= 0, send it instead after this batch of the run's first epoch (with gradient
                accumulation, a batch inside a window).
        """
        self.step, self.signum, self.rank = step, signal.Signals[signal_name], rank
        self.validation_batch, self.times, self.batch = validation_batch, times, batch
        self._sent = False

    def _send(self, trainer) -> None:
        if trainer.global_rank == self.rank and not self._sent:
            self._sent = True  # once: with accumulation, several batches end at the same optimizer step
            for _ in range(self.times):
                os.kill(os.getpid(), self.signum)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if self.batch >= 0:
            if batch_idx == self.batch and trainer.current_epoch == 0:
                self._send(trainer)
        elif self.validation_batch < 0 and trainer.global_step == self.step:
            self._send(trainer)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx == self.validation_batch and not trainer.sanity_checking and trainer.global_step == self.step:
            self._send(trainer)
