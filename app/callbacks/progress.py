"""Lightning's rich progress bar, redrawn a few times a second instead of after every batch.

Lightning 2.6's ``RichProgressBar`` redraws after every training batch and reads the progress-bar metrics each
time (its ``refresh_rate`` only switches it on or off). Reading a logged tensor (``train/loss``) copies it to the
CPU, so every step waited for the GPU to finish before the next step could be queued, and the redraw itself is
host time the GPU then idles through. :class:`ProgressBar` draws at most every ``refresh_seconds``, and always at
a loop's last batch, so the bar shows the same thing for a cost of one such wait per redraw.
"""

from __future__ import annotations

import time
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar


class ProgressBar(RichProgressBar):
    """``RichProgressBar`` redrawn at most every ``refresh_seconds`` (and at the last batch of each loop).

    Args:
        refresh_seconds: Least time between two redraws. 0 redraws after every batch, as Lightning does.
        **kwargs: ``RichProgressBar``'s arguments (``leave``, ``theme``, ``console_kwargs``, ...).
    """

    def __init__(self, refresh_seconds: float = 0.5, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if refresh_seconds < 0:
            raise ValueError(f"refresh_seconds must be >= 0, got {refresh_seconds}")
        self.refresh_seconds = refresh_seconds
        self._drawn_at = float("-inf")

    def _due(self, batch_idx: int, total: float) -> bool:
        now = time.monotonic()
        if batch_idx + 1 >= total or now - self._drawn_at >= self.refresh_seconds:
            self._drawn_at = now
            return True
        return False

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if self._due(batch_idx, self.total_train_batches):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if trainer.sanity_checking or self._due(batch_idx, self.total_val_batches_current_dataloader):
            super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def on_test_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._due(batch_idx, self.total_test_batches_current_dataloader):
            super().on_test_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def on_predict_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self._due(batch_idx, self.total_predict_batches_current_dataloader):
            super().on_predict_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
