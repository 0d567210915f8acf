"""A second task for the template: regress a number from a sequence with a GRU (dict batches, no accuracy).

It is what a fork looks like: a LightningModule and a LightningDataModule of its own, outside ``app/``, that the
machinery trains under every strategy without an edit. Everything it tells the template is its ``spec``;
everything it gets from it is :func:`app.loader.make_loader`. The data is made here, from a seed (no files)::

    python cli.py fit --model=examples.sequence.SequenceRegressor --data=examples.sequence.SequenceData
    python cli.py fit --model=examples.sequence.SequenceRegressor --data=examples.sequence.SequenceData \\
        --trainer.strategy=ddp --trainer.devices=2 --trainer.max_epochs=3
    python cli.py predict --model=examples.sequence.SequenceRegressor --data=examples.sequence.SequenceData \\
        --ckpt_path last
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from torch import nn
from torch.utils.data import Dataset
from torchmetrics import MeanSquaredError

from app.loader import make_loader
from app.task import TaskSpec


class SequenceRegressor(LightningModule):
    # What the template reads: rank checkpoints by the lowest validation MSE; these arguments decide the weights;
    # activation checkpointing recomputes the GRU; the learning rate is --model.lr.
    spec = TaskSpec(
        monitor="val_mse", mode="min", network=("features", "hidden", "layers"), blocks=("GRU",), lr_flag="--model.lr"
    )

    def __init__(self, features: int = 4, hidden: int = 32, layers: int = 1, lr: float = 0.01) -> None:
        """
        Args:
            features: Values per time step (the data's ``features``).
            hidden: The GRU's hidden size.
            layers: Stacked GRU layers.
            lr: Adam's learning rate.
        """
        super().__init__()
        self.save_hyperparameters()
        self.gru = nn.GRU(features, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Sequential(nn.BatchNorm1d(hidden), nn.Linear(hidden, 1))
        self.val_mse, self.test_mse = MeanSquaredError(), MeanSquaredError()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.gru(x.to(self.dtype))
        return self.head(out[:, -1]).squeeze(1)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = nn.functional.mse_loss(self(batch["x"]), batch["y"].to(self.dtype))
        self.log("train_loss", loss, batch_size=len(batch["y"]))
        return loss

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.val_mse(self(batch["x"]), batch["y"].to(self.dtype))
        self.log("val_mse", self.val_mse, prog_bar=True, batch_size=len(batch["y"]))

    def test_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        self.test_mse(self(batch["x"]), batch["y"].to(self.dtype))
        self.log("test_mse", self.test_mse, batch_size=len(batch["y"]))

    def predict_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        return self(batch["x"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


class Sequences(Dataset):
    """Sequences and their targets, one dict per sample (the DataLoader's default collate stacks them)."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "y": self.y[index]}


def make_sequences(count: int, length: int, features: int, seed: int) -> Sequences:
    """Random sequences whose target is a running sum of the first feature plus the last step's second one: the
    network has to carry a value through time."""
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(count, length, features, generator=generator)
    y = x[:, :, 0].sum(dim=1) / length**0.5 + x[:, -1, min(1, features - 1)]
    return Sequences(x, y)


class SequenceData(LightningDataModule):
    def __init__(
        self,
        train_size: int = 2048,
        val_size: int = 256,
        test_size: int = 256,
        length: int = 16,
        features: int = 4,
        batch_size: int = 64,
        seed: int = 0,
    ) -> None:
        """
        Args:
            train_size: Training sequences (made from ``seed``).
            val_size: Validation sequences.
            test_size: Test (and predict) sequences.
            length: Time steps per sequence.
            features: Values per time step (the model's ``features``).
            batch_size: Per device, under every strategy (app.loader.make_loader).
            seed: Seeds the data and the training order.
        """
        super().__init__()
        self.save_hyperparameters()

    def setup(self, stage: str) -> None:
        h = self.hparams
        self.train_set = make_sequences(h.train_size, h.length, h.features, h.seed)
        self.val_set = make_sequences(h.val_size, h.length, h.features, h.seed + 1)
        self.test_set = make_sequences(h.test_size, h.length, h.features, h.seed + 2)

    def _loader(self, dataset: Dataset, train: bool):
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
