"""The tests' own task: what the machinery's tests train, so that they survive a fork that replaces the example.

BoringModel-style and made from a seed (no files, no download): 8x8 one-channel images in ``classes`` classes
(a fixed pattern per class under noise), and a small residual CNN. It uses the template only
as a fork would (``spec`` and :func:`app.loader.make_loader`), and nothing of ``app.fashion_mnist``::

    python cli.py fit --config tests/tiny.yaml
    python cli.py fit --config tests/tiny.yaml --trainer.strategy=ddp --trainer.devices=2
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import TensorDataset
from torchmetrics import MeanMetric
from torchmetrics.classification import MulticlassAccuracy

from app.loader import make_loader
from app.task import TaskSpec

SIZE = 8  # image side
LR = 0.05  # the default --model.lr


def norm_layer(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(1, channels)
    raise ValueError(f"--model.norm must be 'batch' or 'group', got {kind!r}")


class Block(nn.Module):
    """Two conv-norm layers with a skip (ResNet's basic block): the unit activation checkpointing wraps."""

    def __init__(self, width: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.norm1 = norm_layer(norm, width)
        self.conv2 = nn.Conv2d(width, width, 3, padding=1, bias=False)
        self.norm2 = norm_layer(norm, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.norm1(self.conv1(x)))
        return torch.relu(x + self.norm2(self.conv2(out)))


class TinyClassifier(LightningModule):
    # What the template reads: checkpoints ranked by validation accuracy; the arguments that decide the weights;
    # activation checkpointing wraps each Block; hints name --model.lr.
    spec = TaskSpec(
        monitor="val/acc", mode="max", network=("width", "blocks", "classes", "norm"), blocks=("Block",),
        lr_flag="--model.lr",
    )  # fmt: skip

    def __init__(
        self,
        width: int = 4,
        blocks: int = 2,
        classes: int = 4,
        norm: str = "batch",
        lr: float = LR,
        lr_step: int = 0,
        dropout: float = 0.0,
    ) -> None:
        """
        Args:
            width: Channels of every convolution.
            blocks: Residual blocks.
            classes: Output classes (the data's ``classes``).
            norm: ``batch`` or ``group`` normalization.
            lr: SGD's learning rate (momentum 0.9).
            lr_step: Halve the learning rate every ``lr_step`` optimizer steps (a StepLR); 0: keep it.
            dropout: Dropout before the head (random numbers in every training step); 0: no dropout layer.
        """
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(  # layer after layer: what the pipeline strategy deals out to its stages
            OrderedDict(
                conv1=nn.Conv2d(1, width, 3, padding=1, bias=False),
                norm1=norm_layer(norm, width),
                relu=nn.ReLU(),
                **{f"block{i}": Block(width, norm) for i in range(blocks)},
                flatten=nn.Flatten(1),
                **({"dropout": nn.Dropout(dropout)} if dropout else {}),
                head=nn.Linear(width * SIZE * SIZE, classes),
            )
        )
        self.example_input_array = torch.zeros(2, 1, SIZE, SIZE)  # what Lightning's model summary runs
        # the epoch's mean over all ranks' samples; a diverged run's NaN is StopOnNonFinite's to report, not a warning
        self.train_loss = MeanMetric(nan_strategy="ignore")
        self.train_acc = MulticlassAccuracy(classes, average="micro")
        self.val_acc = MulticlassAccuracy(classes, average="micro")
        self.val_loss = MeanMetric(
            nan_strategy="ignore"
        )  # over all ranks' samples (sync_dist would average unequal shards' means)
        self.test_acc = MulticlassAccuracy(classes, average="micro")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x.to(self.dtype))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        logits = self(x)
        loss = nn.functional.cross_entropy(logits, y)
        self.log("train/loss", loss, prog_bar=True, batch_size=len(y))
        self.train_loss(loss.detach(), weight=len(y))
        self.train_acc(logits.detach(), y)
        self.log("train/loss_epoch", self.train_loss, on_step=False, on_epoch=True)
        self.log("train/acc", self.train_acc, on_step=False, on_epoch=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        logits = self(x)
        self.val_acc(logits, y)
        self.val_loss(nn.functional.cross_entropy(logits, y), weight=len(y))
        self.log("val/loss", self.val_loss, batch_size=len(y))
        self.log("val/acc", self.val_acc, prog_bar=True, batch_size=len(y))

    def test_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        x, y = batch
        self.test_acc(self(x), y)
        self.log("test/acc", self.test_acc, batch_size=len(y))

    def predict_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> dict[str, torch.Tensor]:
        probs = self(batch[0]).softmax(dim=1)
        return {"preds": probs.argmax(dim=1), "probs": probs}

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        if not self.hparams.lr_step:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=self.hparams.lr_step, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def make_images(count: int, classes: int, seed: int) -> TensorDataset:
    """``count`` images: each its class's fixed pattern (seed 0) under Gaussian noise, learnt in a few hundred steps."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(classes, (count,), generator=generator)
    noise = torch.randn(count, 1, SIZE, SIZE, generator=generator)
    patterns = torch.randn(classes, 1, SIZE, SIZE, generator=torch.Generator().manual_seed(0))
    return TensorDataset(patterns[labels] + 2 * noise, labels)


class TinyData(LightningDataModule):
    def __init__(
        self,
        train_size: int = 512,
        val_size: int = 128,
        test_size: int = 128,
        classes: int = 4,
        batch_size: int = 16,
        seed: int = 0,
    ) -> None:
        """
        Args:
            train_size: Training images (made from ``seed``).
            val_size: Validation images.
            test_size: Test (and predict) images.
            classes: Classes (the model's ``classes``).
            batch_size: Per device, under every strategy (app.loader.make_loader).
            seed: Seeds the images and the training order.
        """
        super().__init__()
        self.save_hyperparameters()
        self.class_names = [f"class{i}" for i in range(classes)]

    def setup(self, stage: str) -> None:
        h = self.hparams
        self.train_set = make_images(h.train_size, h.classes, h.seed + 1)
        self.val_set = make_images(h.val_size, h.classes, h.seed + 2)
        self.test_set = make_images(h.test_size, h.classes, h.seed + 3)

    def _loader(self, dataset: TensorDataset, train: bool):
        h = self.hparams
        return make_loader(self.trainer, dataset, train=train, batch_size=h.batch_size, seed=h.seed)

    def train_dataloader(self):
        return self._loader(self.train_set, train=True)

    def val_dataloader(self):
        return self._loader(self.val_set, train=False)

    def test_dataloader(self):
        return self._loader(self.test_set, train=False)

    def predict_dataloader(self):
        return self._loader(self.test_set, train=False)
