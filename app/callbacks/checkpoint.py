"""``ModelCheckpoint`` whose ``last.ckpt`` is always the latest state, so ``--ckpt_path last`` resumes from it.

Lightning 2.6 refreshes ``last.ckpt`` only when it also writes a top-k checkpoint: with ``monitor="val/loss"``
an epoch that does not improve the best loss leaves ``last.ckpt`` at an older epoch, and a restart would
silently repeat epochs. This subclass writes ``last.ckpt`` at every point where Lightning would consider saving.

A run that stops before its first validation (``--trainer.max_steps`` inside the first epoch, a signal) has no
``val/loss`` to rank checkpoints by: it writes ``last.ckpt`` only, without Lightning's warning that the monitored
key is missing.

A run stopped by ``--trainer.max_steps`` part-way through an epoch saves the position after its last step (Lightning
counts that epoch as finished, so a resume with a larger limit would skip the rest of the epoch).

A monitor that the model does not log is one line at the end of the first validation (the sanity check, when it
runs), before an epoch of training is lost; Lightning would raise only after the first training epoch.

``--trainer.fast_dev_run`` writes no checkpoint (Lightning 2.6 wrote ``last.ckpt`` at its end, which a later
``--ckpt_path last`` then resumed from, skipping the epoch).
"""

from __future__ import annotations

from lightning.pytorch.callbacks import ModelCheckpoint as LightningModelCheckpoint
from typing_extensions import override

from app.errors import UserError
from app.lightning_internals import fit_loop_state, put_fit_loop_state, refresh_last_checkpoint


class ModelCheckpoint(LightningModelCheckpoint):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._validated = False  # whether a validation (not the sanity check) has run in this fit

    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        self._validated = False
        self._at_max_steps: tuple[int, dict] | None = None

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)
        cut_short = batch_idx + 1 < trainer.num_training_batches  # not the epoch's last batch
        if cut_short and trainer.max_steps not in (None, -1) and trainer.global_step >= trainer.max_steps:
            # The position after the last step, as a step checkpoint holds it: Lightning then ends the epoch (its
            # counters say the epoch finished), and a checkpoint saved from there would resume at the next epoch.
            self._at_max_steps = (trainer.global_step, fit_loop_state(trainer))

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> dict | None:
        state = super().on_save_checkpoint(trainer, pl_module, checkpoint)
        stopped = getattr(self, "_at_max_steps", None)
        if stopped is not None and stopped[0] == trainer.global_step and "loops" in checkpoint:
            put_fit_loop_state(checkpoint, stopped[1])  # resumes inside the epoch that max_steps cut short
        return state

    @override
    def on_train_epoch_end(self, trainer, pl_module) -> None:
        nothing_to_rank = self.monitor is not None and not self._validated
        if not (nothing_to_rank and self.monitor not in trainer.callback_metrics):
            super().on_train_epoch_end(trainer, pl_module)
        refresh_last_checkpoint(self, trainer, at_train_epoch_end=True)

    @override
    def on_train_end(self, trainer, pl_module) -> None:
        if trainer.fast_dev_run:  # "checkpointing is suppressed" (Lightning 2.6's on_train_end wrote last.ckpt)
            return
        super().on_train_end(trainer, pl_module)

    @override
    def on_validation_end(self, trainer, pl_module) -> None:
        check_monitor_logged(self.monitor, trainer, pl_module)
        self._validated = self._validated or not trainer.sanity_checking
        super().on_validation_end(trainer, pl_module)
        refresh_last_checkpoint(self, trainer, at_train_epoch_end=False)


def check_monitor_logged(monitor: str | None, trainer, pl_module) -> None:
    """Stop with one line when a validation has run without logging ``monitor``."""
    if monitor is None or monitor in trainer.callback_metrics or trainer.fast_dev_run:
        return
    if not trainer.sanity_checking and trainer.state.fn != "fit":
        return
    logged = sorted(k for k in trainer.callback_metrics if not k.startswith(("train", "lr-")))
    name = type(pl_module).__name__
    raise UserError(
        f"ModelCheckpoint ranks checkpoints by {monitor!r}, which {name} did not log in validation (it logged: "
        f"{', '.join(logged) or 'nothing'}); set spec = TaskSpec(monitor=..., mode=...) in {name} (app/task.py), or "
        "give your own --trainer.callbacks+=ModelCheckpoint --trainer.callbacks.monitor=..."
    )
