"""The ``Elastic`` callback: Lightning's hooks, handed to its three parts (see :mod:`app.callbacks.elastic`)."""

from __future__ import annotations

import warnings

from lightning.pytorch import Callback
from lightning.pytorch.loggers import CSVLogger
from typing_extensions import override

from app.callbacks.elastic.failure import SaveOnFailure
from app.callbacks.elastic.metrics import MetricsContinuation
from app.callbacks.elastic.world_size import WorldSizeChange
from app.callbacks.stop_plan import stop_plan
from app.launch.restarts import is_restart, restarts_possible
from app.lightning_internals import apply_loader_position


class Elastic(Callback):
    """A resume at another world size, a survivor's save under a restarting launcher, one metrics.csv across
    restarts. The global batch kept is always the one the run started with (``first`` in every checkpoint;
    ``elastic.json`` for a restart that finds no state at all)."""

    stop_role = "survivor_save"  # in the trainer's stop plan (app/callbacks/stop_plan.py)

    def __init__(self, keep_global_batch: bool = True) -> None:
        """
        Args:
            keep_global_batch: On a resume at another number of devices, change ``accumulate_grad_batches`` (or the
                learning rate) so that training goes on with the same global batch. False: leave both as given.
        """
        self.keep_global_batch = keep_global_batch
        self.restartable = False  # under a launcher that restarts the job
        self._restored: dict | None = None  # the checkpoint's state of this callback: the shape it ran at
        self.world = WorldSizeChange(keep_global_batch)
        self.metrics = MetricsContinuation()
        self.failure = SaveOnFailure(self.metrics)

    # ---------------------------------------------------------------- the run's shape, saved and restored
    @override
    def state_dict(self) -> dict:
        return dict(self.world.shape or {})

    @override
    def load_state_dict(self, state_dict: dict) -> None:
        self._restored = dict(state_dict) or None

    # ---------------------------------------------------------------- Lightning's hooks, to the parts
    @override
    def setup(self, trainer, pl_module, stage: str) -> None:
        stop_plan(trainer).join(trainer, self)
        if stage != "fit":
            return
        self.restartable = restarts_possible()
        if self.restartable or is_restart():
            # A restart continues in its run's folder, which holds the checkpoints it resumes from by design.
            warnings.filterwarnings(
                "ignore", message=r"Checkpoint directory .* exists and is not empty", module=r"lightning\.pytorch"
            )
        if self.restartable and any(isinstance(logger, CSVLogger) for logger in trainer.loggers):
            self.metrics.count_rows(trainer)

    @override
    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking and self.restartable:
            self.metrics.validation_start()
            self.failure.validation_start(trainer)

    @override
    def on_fit_start(self, trainer, pl_module) -> None:
        if (first_shape := stop_plan(trainer).first_shape) is not None:  # after every callback's setup
            self.world.started_as = first_shape  # for a restart that has no state to resume from
        self.world.fit_start(trainer, self._restored)

    @override
    def on_train_start(self, trainer, pl_module) -> None:
        # A loader the task had built before the restore (configure_optimizers read estimated_stepping_batches)
        # gets its saved position now: first, since the parts below read it.
        apply_loader_position(trainer)
        if not self.world.train_start(trainer, self._restored, self.restartable):
            return  # a loader of the task's own: none of this applies (a warning said which promise is lost)
        if self.restartable:
            self.failure.arm(trainer)
        self.world.record_changes(trainer)
        self.metrics.train_start(trainer, self._restored, self.restartable)

    @override
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        self.failure.train_batch_end(trainer, self.restartable)

    @override
    def on_save_checkpoint(self, trainer, pl_module, checkpoint: dict) -> None:
        self.failure.save_checkpoint(checkpoint, self.state_key)

    @override
    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        if self.restartable:
            self.failure.exception(trainer, exception)
