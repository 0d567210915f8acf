"""``ModelCheckpoint`` whose ``last.ckpt`` is always the latest state, so ``--ckpt_path last`` resumes from it.

Lightning 2.6 refreshes ``last.ckpt`` only when it also writes a top-k checkpoint: with ``monitor="val/acc"``
an epoch that does not improve the best accuracy leaves ``last.ckpt`` at an older epoch, and a restart would
silently repeat epochs. This subclass writes ``last.ckpt`` at every point where Lightning would consider saving.
"""

from __future__ import annotations

from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint

from app.lightning_internals import refresh_last_checkpoint


class ModelCheckpoint(LightningModelCheckpoint):
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        super().on_train_epoch_end(trainer, pl_module)
        refresh_last_checkpoint(self, trainer, at_train_epoch_end=True)

    def on_validation_end(self, trainer, pl_module) -> None:
        super().on_validation_end(trainer, pl_module)
        refresh_last_checkpoint(self, trainer, at_train_epoch_end=False)
