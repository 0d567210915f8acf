"""One line per epoch, like d2l's: epoch, train loss, val accuracy, seconds, images/s, devices."""

from __future__ import annotations

import time

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info


class EpochSummary(Callback):
    """Prints ``epoch 3 | train loss 0.4120 | val acc 0.8712 | 12.3 s | 4,567 img/s | 2 x cpu (ddp)``.

    Images/s counts the images of all devices over the training time of the epoch (validation excluded).
    """

    def __init__(self) -> None:
        self._train_seconds = 0.0
        self._started: float | None = None
        self._images = 0
        self._loss_sum = 0.0

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._epoch_start = self._started = time.perf_counter()
        self._train_seconds, self._images, self._loss_sum = 0.0, 0, 0.0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs, batch, batch_idx: int) -> None:
        n = len(batch[1])
        self._images += n
        loss = outputs.get("batch_loss", outputs["loss"]) if isinstance(outputs, dict) else outputs
        self._loss_sum += float(loss) * n

    def _pause(self) -> None:
        if self._started is not None:
            self._train_seconds += time.perf_counter() - self._started
            self._started = None

    def on_validation_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking:
            self._pause()

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if not trainer.sanity_checking and trainer.training:
            self._started = time.perf_counter()

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pause()
        # Every rank reaches this hook, so the reduction is safe; it makes the numbers global.
        totals = torch.tensor([self._images, self._loss_sum], dtype=torch.float64, device=pl_module.device)
        totals = trainer.strategy.reduce(totals, reduce_op="sum")
        images, loss_sum = totals.tolist()
        seconds = time.perf_counter() - self._epoch_start
        parts = [f"epoch {trainer.current_epoch}", f"train loss {loss_sum / max(images, 1):.4f}"]
        val_acc = trainer.callback_metrics.get("val/acc")
        if val_acc is not None:
            parts.append(f"val acc {float(val_acc):.4f}")
        parts += [
            f"{seconds:.1f} s",
            f"{images / max(self._train_seconds, 1e-9):,.0f} img/s",
            f"{trainer.num_devices * trainer.num_nodes} x {trainer.strategy.root_device.type} "
            f"({_strategy_name(trainer)})",
        ]
        rank_zero_info(" | ".join(parts))


def _strategy_name(trainer: Trainer) -> str:
    strategy = trainer.strategy
    name = getattr(strategy, "strategy_name", None) or type(strategy).__name__.removesuffix("Strategy").lower()
    return f"{name}_spawn" if getattr(strategy, "_start_method", None) == "spawn" else name
