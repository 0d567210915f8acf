"""``ModelCheckpoint`` whose ``last.ckpt`` is always the latest state, so ``--ckpt_path last`` resumes from it.

Lightning 2.6 refreshes ``last.ckpt`` only when it also writes a top-k checkpoint: with ``monitor="val/acc"``
an epoch that does not improve the best accuracy leaves ``last.ckpt`` at an older epoch, and a restart would
silently repeat epochs. This subclass writes ``last.ckpt`` at every point where Lightning would consider saving.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint


class ModelCheckpoint(LightningModelCheckpoint):
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        if self._should_save_on_train_epoch_end(trainer):
            self._refresh_last(trainer)

    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)
        if not self._should_save_on_train_epoch_end(trainer):
            self._refresh_last(trainer)

    def _refresh_last(self, trainer) -> None:
        # Skips sanity checking, fast_dev_run and a step already saved (so the top-k save is not repeated).
        if self.save_last and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
