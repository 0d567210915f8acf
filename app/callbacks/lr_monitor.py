"""Lightning's ``LearningRateMonitor``, one row per optimizer step.

Lightning's logs at the start of every training batch that falls on a logging step. With
``accumulate_grad_batches=N`` (set by you, or by the Elastic callback to keep the global batch after a change of
world size) that is N rows of the same step and value in ``metrics.csv``, N points in TensorBoard; and with its
default ``logging_interval=None`` an optimizer without a scheduler is logged again at each epoch's start, a second
row for that step. This one logs at the first batch of each optimizer step only, and every learning rate there
(``logging_interval="step"``: a scheduler stepped per epoch shows its value at every step); the rest is Lightning's.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import LearningRateMonitor as LightningLearningRateMonitor
from typing_extensions import override


class LearningRateMonitor(LightningLearningRateMonitor):
    def __init__(self, logging_interval: str | None = "step", **kwargs: Any) -> None:
        """
        Args:
            logging_interval: ``step`` (every logging step), ``epoch`` or ``None`` (as Lightning's: each scheduler at
                its own interval).
            **kwargs: Lightning's other arguments (``log_momentum``, ``log_weight_decay``).
        """
        super().__init__(logging_interval=logging_interval, **kwargs)
        self._step_seen: int | None = None

    @override
    def on_train_batch_start(self, trainer, *args: Any, **kwargs: Any) -> None:
        if trainer.global_step == self._step_seen:
            return  # a later batch of the same accumulation window: the same step, the same learning rate
        self._step_seen = trainer.global_step
        super().on_train_batch_start(trainer, *args, **kwargs)
