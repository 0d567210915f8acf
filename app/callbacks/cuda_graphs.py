"""Step boundaries for CUDA graphs: ``torch.compiler.cudagraph_mark_step_begin()`` before every batch.

``torch.compile(mode="reduce-overhead")`` records the compiled forward and backward as CUDA graphs and replays them,
which removes the launch cost that bounds a ResNet-18 step on a GPU. Its graph trees must know where one step ends
and the next begins: a replay overwrites the memory that the previous step's outputs live in. Without a mark they
infer the boundary from the order of forward and backward calls, and under ``cli.py fit`` that inference does not
hold (issue 44: 5.08 s per epoch against the plain loop's 0.80 on one H200). Each batch's start is a step's start,
so this callback says so, on every stage, on CUDA devices (on CPU there are no graphs; it does nothing). With
``accumulate_grad_batches=N`` a training step is N batches (the gradients of the first are still to be added to),
so the mark comes before every N-th batch.

What a mark asks of the task: no output of a compiled region may be read after the next batch starts. A tensor
that lives longer (kept for a plot, stored on the module) must be cloned; the template's task keeps none (its
loss, predictions and metrics are computed from the network's output within the step). Reading one anyway is an
error from torch that names the tensor, not a wrong number.

On by default in ``cli.py`` (``--drop_callbacks=[CUDAGraphSteps]`` turns it off).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from typing_extensions import override


class CUDAGraphSteps(Callback):
    """Mark each batch's start as a new step for ``torch.compile``'s CUDA graphs (on CUDA devices only)."""

    def __init__(self) -> None:
        self._on_cuda = False

    @override
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        self._on_cuda = trainer.strategy.root_device.type == "cuda"

    def _mark(self) -> None:
        if self._on_cuda:
            torch.compiler.cudagraph_mark_step_begin()

    @override
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if batch_idx % trainer.accumulate_grad_batches == 0:
            self._mark()

    @override
    def on_validation_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._mark()

    @override
    def on_test_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._mark()

    @override
    def on_predict_batch_start(
        self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int, dataloader_idx: int = 0
    ) -> None:
        self._mark()
