"""Lightning's rich progress bar, redrawn a few times a second instead of after every batch.

Two things in Lightning 2.6 make a GPU wait for the host at every training step when a progress bar is shown:

- ``RichProgressBar`` redraws after every batch and reads the progress-bar metrics each time (its
  ``refresh_rate`` only switches it on or off);
- every value logged with ``prog_bar=True, on_step=True`` is turned into a Python float after every batch, by the
  trainer itself, whether or not a bar is drawn.

Reading a tensor's value on the host waits for the device to compute it, so the next step cannot be queued while
the GPU works, and the redraw's host time is time the GPU idles. :class:`ProgressBar` draws at most every
``refresh_seconds`` (and at each loop's first and last batch), and shows per-step values such as ``train/loss``
by reading them from the trainer's ``callback_metrics`` when it draws, so they can be logged without
``prog_bar=True``.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import RichProgressBar
from lightning.pytorch.utilities import rank_zero_info


def live_bar_console(trainer: Trainer) -> Any:
    """The console of a rich progress bar live in this process, or None.

    While the bar is live it redraws by moving the cursor up, and erases or overdraws whatever was written to the
    terminal outside its console; that console prints lines above the bar."""
    bar = trainer.progress_bar_callback
    progress = getattr(bar, "progress", None) if isinstance(bar, RichProgressBar) else None
    return progress.console if progress is not None and progress.live.is_started else None


def console_print(trainer: Trainer, message: Any) -> None:
    """Print a line or a rich renderable on global rank 0 so that it stays on the screen (above a live bar)."""
    if not trainer.is_global_zero:
        return
    console = live_bar_console(trainer)
    if console is not None:
        console.print(message, markup=False, highlight=False, soft_wrap=isinstance(message, str))
    elif isinstance(message, str):
        rank_zero_info(message)
    else:
        from rich.console import Console

        Console().print(message)


class _CurrentStderr:
    """A stream that writes to ``sys.stderr`` as it is at each write, not as it was when a handler was made."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def log_above_the_bar() -> None:
    """Make Lightning's own lines ("`Trainer.fit` stopped: ...") print above a live bar, not over it.

    Lightning's loggers print through a ``StreamHandler`` that holds the ``sys.stderr`` of import time. While the bar
    is live in a terminal, rich replaces ``sys.stderr`` with a proxy that prints above the bar; a write to the old
    stream lands at the cursor instead, on the bar's line, and the next redraw leaves a copy of the bar behind.
    """
    for name in ("lightning.pytorch", "lightning.fabric"):
        for handler in logging.getLogger(name).handlers:
            if type(handler) is logging.StreamHandler and handler.stream in (sys.__stderr__, sys.stderr):
                handler.setStream(_CurrentStderr())


class ProgressBar(RichProgressBar):
    """``RichProgressBar`` redrawn at most every ``refresh_seconds`` (and at the first and last batch of each loop).

    Args:
        refresh_seconds: Least time between two redraws. 0 redraws after every batch, as Lightning does.
        show: Values to show besides those logged with ``prog_bar=True``, read only when the bar redraws: from the
            module's ``step_values`` dict (the latest training step's values) when it has them, else logged ones.
        **kwargs: ``RichProgressBar``'s arguments (``leave``, ``theme``, ``console_kwargs``, ...).
    """

    def __init__(self, refresh_seconds: float = 0.5, show: list[str] | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if refresh_seconds < 0:
            raise ValueError(f"refresh_seconds must be >= 0, got {refresh_seconds}")
        self.refresh_seconds = refresh_seconds
        self.show = ["train/loss"] if show is None else list(show)
        self._drawn_at = float("-inf")

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        if self.is_enabled:
            log_above_the_bar()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """Every rank reads the epoch's metrics here, together, before rank 0's bar does.

        Lightning's bar reads them on rank 0 only, and the first read of the epoch computes the torchmetrics objects a
        module logged with ``on_epoch=True`` in ``training_step``: a collective. Alone on rank 0 it waited forever
        for the other ranks (a fork's task hung under ddp and horovod; Lightning issue 21264). Later reads, the
        bar's and the loggers', get the values computed here."""
        if trainer.world_size > 1:
            trainer.progress_bar_metrics  # noqa: B018  (the read is the point: it computes on every rank)
        super().on_train_epoch_end(trainer, pl_module)

    def on_train_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The bar is finished: leave it where it is, so what is printed at the end of the run (the run report)
        comes below it, not above a bar redrawn under everything."""
        if self.progress is not None:
            self.progress.stop()  # Lightning's teardown stops it again (a no-op) and prepares the next stage's

    def get_metrics(self, trainer: Trainer, pl_module: LightningModule) -> dict[str, Any]:
        items = super().get_metrics(trainer, pl_module)
        items.pop("v_num", None)  # the version folder: printed once at the start, not worth a place on the bar
        # The module's latest step values first (ImageClassifier keeps them every step but logs them only at the
        # steps where they are written or read), then what was logged.
        latest = getattr(pl_module, "step_values", None) or {}
        logged = trainer.callback_metrics
        for name in self.show:
            value = latest.get(name, logged.get(name))
            if value is not None and name not in items:
                items[name] = float(value)  # the one read of the device per redraw
        return items

    def _due(self, batch_idx: int, total: float) -> bool:
        now = time.monotonic()
        # the first batch too: rich's it/s needs two updates of the loop's bar
        if batch_idx == 0 or batch_idx + 1 >= total or now - self._drawn_at >= self.refresh_seconds:
            self._drawn_at = now
            return True
        return False

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        if not self.is_disabled and self._due(batch_idx, self.total_train_batches):
            super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    def on_validation_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if self.is_disabled:  # ranks other than 0 draw nothing (and have no loop indices to read)
            return
        if trainer.sanity_checking or self._due(batch_idx, self.total_val_batches_current_dataloader):
            super().on_validation_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def on_test_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not self.is_disabled and self._due(batch_idx, self.total_test_batches_current_dataloader):
            super().on_test_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)

    def on_predict_batch_end(
        self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        if not self.is_disabled and self._due(batch_idx, self.total_predict_batches_current_dataloader):
            super().on_predict_batch_end(trainer, pl_module, outputs, batch, batch_idx, dataloader_idx)
