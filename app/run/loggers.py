"""TensorBoard as a person opens it: the accuracy and loss curves first.

TensorBoard groups scalars by the part of their name before the first ``/`` and shows the groups in alphabetical
order. Lightning's names put ``epoch`` (the epoch number against the step, a staircase) first, then ``lr-SGD``,
``perf``, ``train``, ``val``: what anyone opens it for (how the accuracy and the loss go) came last, in two groups.
This logger writes ``train/acc`` as ``acc/train``, ``val/loss`` as ``loss/val`` and ``train/loss_epoch`` as
``loss/train_epoch``, so each metric is one group with its splits side by side (``acc``, then ``loss``, before
``lr-SGD`` and ``perf``), and leaves ``epoch`` out (every point already has its step; metrics.csv keeps the epoch
column). Only TensorBoard's names change: the
metrics the callbacks monitor, the checkpoint names and metrics.csv keep Lightning's.
"""

from __future__ import annotations

from collections.abc import Mapping

from lightning.pytorch.loggers import TensorBoardLogger as LightningTensorBoardLogger
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

SPLITS = ("train", "val", "test", "predict")


def tensorboard_name(name: str) -> str:
    """``train/acc`` -> ``acc/train``, ``val/loss`` -> ``loss/val``, ``train/loss_epoch`` -> ``loss/train_epoch``
    (Lightning's suffix of a value logged per step and per epoch); other names as they are."""
    split, slash, metric = name.partition("/")
    if not (slash and split in SPLITS and metric):
        return name
    for suffix in ("_epoch", "_step"):
        if metric.endswith(suffix) and len(metric) > len(suffix):
            return f"{metric.removesuffix(suffix)}/{split}{suffix}"
    return f"{metric}/{split}"


class TensorBoardLogger(LightningTensorBoardLogger):
    """Lightning's TensorBoard logger with the accuracy and loss groups first (see the module's docstring)."""

    @rank_zero_only
    @override
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        shown = {tensorboard_name(name): value for name, value in metrics.items() if name != "epoch"}
        if shown:
            super().log_metrics(shown, step)
